//! `strata generate` and `strata chat`: open an engine (`runtime::engine`), stream text.

use std::io::{BufRead, Write};

use anyhow::{Context, Result, bail};
use std::sync::atomic::AtomicBool;
use strata_engine::runtime::engine::Engine;

use strata_engine::runtime::generate::{GenerateError, GenerateOptions, GenerateStats, generate, generate_pieces};
use strata_engine::runtime::sampling::{Sampler, SamplingParams, TokenLogprob};
use strata_engine::runtime::session::SessionError;
use strata_engine::tokenizer::Tokenizer;
use strata_engine::tokenizer::{ChatMessage, ChatRequest};

use crate::{EngineArgs, GenerateArgs, SamplingArgs};

/// Opens the engine of `args` and logs what was loaded.
fn open(args: &EngineArgs) -> Result<Engine> {
    let engine = Engine::open(&args.engine)?;
    eprintln!("strata: {}", engine.loaded_line());
    Ok(engine)
}
fn sampler(args: &SamplingArgs, vocab: usize) -> Result<Sampler> {
    let params = SamplingParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: args.seed,
        logit_bias: Vec::new(),
    };
    Sampler::new(params, vocab).context("invalid sampling flags")
}

fn system_messages(args: &EngineArgs) -> Vec<ChatMessage> {
    args.system
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.clone()))
        .collect()
}

fn chat_request(messages: Vec<ChatMessage>) -> ChatRequest {
    ChatRequest {
        messages,
        add_generation_prompt: true,
        ..ChatRequest::default()
    }
}

fn print_summary(stats: &GenerateStats) {
    eprintln!("strata: {}", stats.summary());
}

fn stream_to_stdout(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (`| head`) ends the output, not the program.
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// `strata generate`.
pub fn run_generate(args: GenerateArgs) -> Result<()> {
    let l = open(&args.engine)?;
    let tokens = if args.chat {
        let t = l
            .template
            .as_ref()
            .context("--chat needs a chat template, and this model has none (tokenizer.chat_template)")?;
        let request = chat_request(
            system_messages(&args.engine)
                .into_iter()
                .chain([ChatMessage::new("user", args.prompt.clone())])
                .collect(),
        );
        t.prompt(&l.tokenizer, &request)?.ids
    } else {
        l.tokenizer.encode(&args.prompt, true, false)?
    };
    let mut session = l.session()?;
    let opts = GenerateOptions {
        logprobs: args.logprobs.as_ref().map(|_| args.top_logprobs as usize),
        ..GenerateOptions::new(args.engine.max_tokens, args.engine.sampling.stop.clone())
    };
    let mut s = sampler(&args.engine.sampling, l.model.weights.output.rows)?;
    let mut entries = Vec::new();
    let (_, stats) = generate_pieces(
        &mut session,
        &l.tokenizer,
        &tokens,
        &opts,
        &mut s,
        &AtomicBool::new(false),
        &mut |t, lp| {
            stream_to_stdout(t);
            entries.extend(lp);
        },
    )?;
    stream_to_stdout("\n");
    if let Some(path) = &args.logprobs {
        write_logprobs(path, &l.tokenizer, &entries)?;
    }
    print_summary(&stats);
    l.emit_expert_cache(None);
    l.check_routing_dump()?;
    Ok(())
}

/// Writes `--logprobs`: one JSON line a token.
fn write_logprobs(path: &std::path::Path, tokenizer: &Tokenizer, entries: &[TokenLogprob]) -> Result<()> {
    let text =
        |id: u32| String::from_utf8_lossy(&tokenizer.decode_bytes(&[id], false).unwrap_or_default()).into_owned();
    let mut out = String::new();
    for e in entries {
        let top: Vec<serde_json::Value> = e
            .top
            .iter()
            .map(|&(id, lp)| serde_json::json!({ "id": id, "token": text(id), "logprob": lp }))
            .collect();
        let line = serde_json::json!({ "id": e.id, "token": text(e.id), "logprob": e.logprob, "top_logprobs": top });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("cannot write --logprobs {}", path.display()))
}

/// `strata chat`.
pub fn run_chat(args: EngineArgs) -> Result<()> {
    let l = open(&args)?;
    let Some(template) = l.template.as_ref() else {
        bail!("`strata chat` needs a chat template, and this model has none (tokenizer.chat_template)");
    };
    let mut session = l.session()?;
    let opts = GenerateOptions::new(args.max_tokens, args.sampling.stop.clone());
    let mut s = sampler(&args.sampling, l.model.weights.output.rows)?;
    let mut messages: Vec<ChatMessage> = system_messages(&args);
    eprintln!("strata chat: type a message; an empty line or end of input quits");
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage::new("user", line.trim_end().to_string()));
        let tokens = template.prompt(&l.tokenizer, &chat_request(messages.clone()))?.ids;
        let mut answer = String::new();
        let result = generate(&mut session, &l.tokenizer, &tokens, &opts, &mut s, &mut |t| {
            answer.push_str(t);
            stream_to_stdout(t)
        });
        let stats = match result {
            Ok((_, stats)) => stats,
            // A turn over the context ends that turn, not the chat: the message is dropped and the user may ask
            // something shorter.
            Err(GenerateError::Session(e @ SessionError::ContextOverflow { .. })) if answer.is_empty() => {
                eprintln!("strata chat: {e}; that message was dropped (an empty line quits)");
                messages.pop();
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        stream_to_stdout("\n");
        print_summary(&stats);
        l.emit_expert_cache(None);
        messages.push(ChatMessage::new("assistant", answer));
    }
    l.check_routing_dump()?;
    Ok(())
}
