//! `strata generate` and `strata chat`: load a model, run it on the CPU backend, stream text.

use std::io::{BufRead, IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use strata_engine::backend::AnyBackend;
use strata_engine::model::Model;
use strata_engine::models;
use strata_engine::runtime::generate::{GenerateError, GenerateOptions, GenerateStats, generate};
use strata_engine::runtime::sampling::{Sampler, SamplingParams};
use strata_engine::runtime::session::{Session, SessionConfig, SessionError};
use strata_engine::tokenizer::{ChatMessage, ChatRequest, ChatTemplate, Tokenizer};

use crate::{EngineArgs, GenerateArgs, SamplingArgs};

struct Loaded {
    model: Model,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

fn load(args: &EngineArgs) -> Result<Loaded> {
    strata_engine::backend::cpu::init_threads(args.threads).context("cannot start the worker threads")?;
    let path = models::resolve(Some(&args.model))?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_message(format!("loading {}", path.display()));
        b.enable_steady_tick(Duration::from_millis(100));
        b
    });
    let start = Instant::now();
    let model = Model::load(&path).with_context(|| format!("cannot load model {}", path.display()))?;
    let md = model.gguf.metadata();
    let tokenizer = Tokenizer::from_metadata(md).with_context(|| format!("{}: tokenizer", path.display()))?;
    let template = ChatTemplate::from_metadata(md).with_context(|| format!("{}: chat template", path.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    eprintln!(
        "strata: loaded {} ({}, {} layers) in {} ms",
        path.display(),
        model.hp.arch,
        model.hp.n_layer,
        start.elapsed().as_millis()
    );
    Ok(Loaded {
        model,
        tokenizer,
        template,
    })
}

/// The backend of `--device`; a CUDA device reports its start (kernels compiled or read from the cache).
fn open_backend(args: &EngineArgs) -> Result<AnyBackend> {
    let start = Instant::now();
    let be = AnyBackend::open(&args.device).with_context(|| format!("cannot use --device {}", args.device))?;
    if let Some(c) = be.cuda() {
        let k = &c.gpu().compile;
        eprintln!(
            "strata: {} ready in {} ms (kernels for {} {} in {:.0} ms)",
            args.device,
            start.elapsed().as_millis(),
            k.arch,
            if k.cached { "read from the cache" } else { "compiled" },
            k.ms
        );
    }
    Ok(be)
}

fn session_config(args: &EngineArgs) -> SessionConfig {
    SessionConfig {
        max_context: args.max_context,
        kv: args.kv,
        prefill_chunk: args.prefill.0,
    }
}

fn sampler(args: &SamplingArgs, vocab: usize) -> Result<Sampler> {
    let params = SamplingParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: args.seed,
        ..SamplingParams::default()
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
    // The device first: a missing GPU is reported before the model is read.
    let backend = open_backend(&args.engine)?;
    let l = load(&args.engine)?;
    let prompt_text = if args.chat {
        let t = l
            .template
            .as_ref()
            .context("--chat needs a chat template, and this model has none (tokenizer.chat_template)")?;
        t.render(&chat_request(
            system_messages(&args.engine)
                .into_iter()
                .chain([ChatMessage::new("user", args.prompt.clone())])
                .collect(),
        ))?
    } else {
        args.prompt.clone()
    };
    let tokens = l.tokenizer.encode(&prompt_text, true, args.chat)?;
    let mut session = Session::new(&l.model, backend, session_config(&args.engine))?;
    // STRATA_FAULT (fault injection, seed 000) applies here as in `strata serve`, with the fallback on.
    session.set_fault_policy(strata_engine::device::fault::FaultPlan::from_env()?, true);
    let opts = GenerateOptions {
        max_tokens: args.engine.max_tokens,
        stop: args.engine.sampling.stop.clone(),
    };
    let mut s = sampler(&args.engine.sampling, l.model.weights.output.rows)?;
    let (_, stats) = generate(&mut session, &l.tokenizer, &tokens, &opts, &mut s, &mut |t| {
        stream_to_stdout(t)
    })?;
    stream_to_stdout("\n");
    print_summary(&stats);
    Ok(())
}

/// `strata chat`.
pub fn run_chat(args: EngineArgs) -> Result<()> {
    let backend = open_backend(&args)?;
    let l = load(&args)?;
    let Some(template) = l.template.as_ref() else {
        bail!("`strata chat` needs a chat template, and this model has none (tokenizer.chat_template)");
    };
    let mut session = Session::new(&l.model, backend, session_config(&args))?;
    // STRATA_FAULT (fault injection, seed 000) applies here as in `strata serve`, with the fallback on.
    session.set_fault_policy(strata_engine::device::fault::FaultPlan::from_env()?, true);
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        stop: args.sampling.stop.clone(),
    };
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
        let text = template.render(&chat_request(messages.clone()))?;
        let tokens = l.tokenizer.encode(&text, true, true)?;
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
        messages.push(ChatMessage::new("assistant", answer));
    }
    Ok(())
}
