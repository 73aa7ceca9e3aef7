//! `strata`: the engine's command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use strata_engine::fixtures::synth::{SynthArch, SynthSpec};
use strata_engine::fixtures::upcycle::{UpcycleMode, UpcycleSpec, upcycle};
use strata_engine::gguf::GgufModel;
use strata_engine::memory::MemoryEstimate;
use strata_engine::model::inspect::{ModelSummary, human_bytes};
use strata_engine::models;
use strata_engine::quant::GgmlType;
use strata_engine::runtime::engine::EngineFlags;

mod bench_cmd;
mod device_cmd;
mod experts_cmd;
mod generate_cmd;

/// Strata: an inference engine for Mixture-of-Experts LLMs in GGUF.
#[derive(Parser)]
#[command(
    name = "strata",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("STRATA_BUILD_REV"), ")"),
    about
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF model's architecture, hyper-parameters, tokenizer, tensors and memory estimate.
    Inspect {
        /// A .gguf file (any shard of a set), or `default` for the default model (fetched on first use).
        #[arg(default_value = "default")]
        model: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Generate models: synthetic ones at any shape, or MoEs upcycled from a dense model.
    Fixtures {
        #[command(subcommand)]
        command: FixturesCommand,
    },
    /// Manage the model cache.
    Models {
        #[command(subcommand)]
        command: ModelsCommand,
    },
    /// Generate text from a prompt on the CPU or a GPU (--device), streaming it to stdout; the summary goes to
    /// stderr.
    Generate(GenerateArgs),
    /// An interactive chat through the model's chat template (multi-turn, reusing the cached prefix).
    Chat(EngineArgs),
    /// Serve the OpenAI and Anthropic HTTP APIs over a supervised engine worker process.
    Serve(strata_engine::serve::ServeArgs),
    /// The engine worker `strata serve` starts (JSON lines on stdin/stdout); not for direct use.
    #[command(hide = true)]
    Worker(strata_engine::serve::WorkerFlags),
    /// Prefill and decode tok/s and peak RSS on the CPU or a GPU (--device), beside llama.cpp's llama-bench on the
    /// same file.
    Bench(bench_cmd::BenchArgs),
    /// CUDA devices: --list-devices, --selftest [--model M --max-context N --kv T --prefill N], --check-kernels.
    Device(device_cmd::DeviceArgs),
    /// Every STRATA_* environment switch with its value here, its default and what it does.
    Switches,
    /// Routing traces and the expert-cache simulator (hit rates beside Belady's optimum).
    Experts {
        #[command(subcommand)]
        command: experts_cmd::ExpertsCommand,
    },
}

/// Engine, generation and sampling settings shared by `generate` and `chat`.
#[derive(Args)]
struct EngineArgs {
    #[command(flatten)]
    engine: EngineFlags,
    /// Most tokens to generate per answer.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    system: SystemArg,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Write each generated token's log-probability to this file, one JSON line a token: `{"id", "token",
    /// "logprob", "top_logprobs": [{"id", "token", "logprob"}]}` (the distribution after the penalties, at
    /// temperature 1, as `strata serve` reports it).
    #[arg(long, value_name = "FILE")]
    logprobs: Option<std::path::PathBuf>,
    /// Alternatives per token in `--logprobs` (0 to 20).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=20))]
    top_logprobs: u64,
}

/// A system message for `--chat` and `chat` (without it the template's default, if any, applies).
#[derive(Args)]
struct SystemArg {
    /// The system message, replacing the chat template's default one (if it has one).
    #[arg(long)]
    system: Option<String>,
}

/// Sampling flags (llama.cpp's names and defaults, except the temperature: 0, greedy, unless asked).
#[derive(Args)]
struct SamplingArgs {
    /// Temperature; 0 is greedy (argmax).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens of history the penalties look at; 0 turns them off, -1 is the whole history.
    #[arg(long, default_value_t = 64, allow_hyphen_values = true)]
    repeat_last_n: i32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Seed of the random draw: the same seed and prompt give the same tokens.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text is generated (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
}

#[derive(Subcommand)]
enum FixturesCommand {
    /// Write a seeded synthetic model; the same arguments give a byte-identical file.
    Synth(SynthArgs),
    /// Turn a dense llama model into a Mixtral-layout MoE from its own FFN weights (no requantization).
    Upcycle {
        /// The dense source model (`default` for the default model).
        #[arg(long, default_value = "default")]
        model: String,
        /// Output .gguf path.
        #[arg(long)]
        out: PathBuf,
        /// `identical`: every expert is the layer's FFN (equals the dense model); `shifted`: expert e of layer i
        /// is layer (i+e) mod L's FFN.
        #[arg(long, value_enum)]
        mode: UpcycleMode,
        /// Experts per layer.
        #[arg(long, default_value_t = 8)]
        experts: u32,
        /// Experts used per token (top-k).
        #[arg(long, default_value_t = 2)]
        experts_used: u32,
        /// Seed of the router weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Preset {
    /// A 4-layer, 16-expert qwen3moe at Q8_0 (tests, about 15 MiB).
    TinyQwen3moe,
    /// Qwen3-30B-A3B's shape at Q4_K with a Q6_K output (about 17 GB).
    Qwen3_30bA3b,
}

#[derive(Args)]
struct SynthArgs {
    /// Output .gguf path.
    #[arg(long)]
    out: PathBuf,
    /// Starting shape; the flags below override its fields.
    #[arg(long, value_enum, default_value = "tiny-qwen3moe")]
    preset: Preset,
    #[arg(long, value_enum)]
    arch: Option<SynthArch>,
    #[arg(long)]
    layers: Option<u32>,
    #[arg(long)]
    embd: Option<u32>,
    /// Dense FFN width.
    #[arg(long)]
    ff: Option<u32>,
    #[arg(long)]
    heads: Option<u32>,
    #[arg(long)]
    heads_kv: Option<u32>,
    #[arg(long)]
    head_dim: Option<u32>,
    #[arg(long)]
    experts: Option<u32>,
    /// Experts used per token (top-k).
    #[arg(long)]
    experts_used: Option<u32>,
    /// Expert FFN width.
    #[arg(long)]
    ff_exp: Option<u32>,
    #[arg(long)]
    vocab: Option<u32>,
    /// Context length written to the metadata, in tokens.
    #[arg(long)]
    ctx: Option<u32>,
    /// Quant type of every weight class (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...).
    #[arg(long = "type", value_parser = parse_type)]
    ty: Option<GgmlType>,
    #[arg(long, value_parser = parse_type)]
    type_embd: Option<GgmlType>,
    #[arg(long, value_parser = parse_type)]
    type_output: Option<GgmlType>,
    #[arg(long, value_parser = parse_type)]
    type_attn: Option<GgmlType>,
    #[arg(long, value_parser = parse_type)]
    type_ffn: Option<GgmlType>,
    #[arg(long, value_parser = parse_type)]
    type_experts: Option<GgmlType>,
    #[arg(long, value_parser = parse_type)]
    type_router: Option<GgmlType>,
    /// Share the embedding as the output projection.
    #[arg(long)]
    tied_output: bool,
    /// Filler tokens (past the bytes and the specials) as words that render as text, not unused tokens: a
    /// random model's streams then carry text (the qwen3-30b-a3b preset's default).
    #[arg(long)]
    word_fillers: bool,
    /// Zipf exponent of expert popularity (0: uniform routing).
    #[arg(long)]
    zipf: Option<f64>,
    /// Seed of the random draw: the same seed and prompt give the same tokens.
    #[arg(long)]
    seed: Option<u64>,
    /// Write the Q4_K/Q6_K projections as random blocks of those types instead of quantizing random floats
    /// (about 20x faster; for benchmark models, where only shapes and types matter).
    #[arg(long)]
    random_blocks: bool,
}

#[derive(Subcommand)]
enum ModelsCommand {
    /// Fetch models into the cache (checked by sha256; does nothing when they are there).
    Fetch {
        /// `default` (the default model only) or `all` (also gemma-3-270m and llama.cpp's test vocabularies).
        #[arg(default_value = "all")]
        what: String,
    },
    /// Print the cache folder and the default model's path.
    Path,
}

fn parse_type(s: &str) -> Result<GgmlType, String> {
    GgmlType::from_name(s).ok_or_else(|| {
        let names: Vec<_> = GgmlType::ALL.iter().map(|t| t.name()).collect();
        format!("unknown quant type `{s}`; known: {}", names.join(", "))
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A reader that leaves early (`strata inspect --json | head`, `strata generate ... | head`) ends strata as it
    // ends Unix tools, by SIGPIPE, instead of a panic in println! or generating on for nobody (Rust ignores the
    // signal). `serve` keeps ignoring it: a client closing its connection must not end the server.
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_)) {
        // SAFETY: setting a signal's disposition to its default before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata: error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, skipping a cause whose text the message already carries (the library
/// errors embed their I/O cause, and anyhow's `{:#}` would print it twice).
fn error_chain(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Opens a model given as a path or `default`; the GGUF errors already name the file.
fn open_model(arg: &str) -> Result<GgufModel> {
    let path = models::resolve(Some(arg))?;
    Ok(GgufModel::open(&path)?)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Inspect { model, json } => {
            let gguf = open_model(&model)?;
            let summary = ModelSummary::new(&gguf);
            let memory = MemoryEstimate::new(&gguf, summary.hparams.as_ref());
            if json {
                #[derive(serde::Serialize)]
                struct Inspected<'a> {
                    #[serde(flatten)]
                    summary: &'a ModelSummary,
                    memory: &'a MemoryEstimate,
                }
                let out = Inspected {
                    summary: &summary,
                    memory: &memory,
                };
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print!("{}{}", summary.to_text(), memory.to_text());
            }
        }
        Command::Fixtures {
            command: FixturesCommand::Synth(args),
        } => {
            let spec = synth_spec(&args);
            let start = Instant::now();
            let bytes = spec
                .write_with(&args.out, args.random_blocks)
                .with_context(|| format!("cannot write {}", args.out.display()))?;
            report_written(&args.out, bytes, start);
        }
        Command::Fixtures {
            command:
                FixturesCommand::Upcycle {
                    model,
                    out,
                    mode,
                    experts,
                    experts_used,
                    seed,
                },
        } => {
            let src = open_model(&model)?;
            let spec = UpcycleSpec {
                mode,
                n_expert: experts,
                n_expert_used: experts_used,
                seed,
            };
            let start = Instant::now();
            let bytes = upcycle(&src, &spec, &out).with_context(|| format!("cannot upcycle into {}", out.display()))?;
            report_written(&out, bytes, start);
        }
        Command::Models {
            command: ModelsCommand::Fetch { what },
        } => {
            if what != "default" && what != "all" {
                bail!("`strata models fetch` takes `default` or `all`, not `{what}`");
            }
            models::fetch(&what)?;
        }
        Command::Models {
            command: ModelsCommand::Path,
        } => {
            println!("cache         {}", models::models_dir().display());
            println!("default model {}", models::cached(models::DEFAULT_MODEL_FILE).display());
        }
        Command::Generate(args) => generate_cmd::run_generate(args)?,
        Command::Chat(args) => generate_cmd::run_chat(args)?,
        Command::Serve(args) => strata_engine::serve::run(args)?,
        Command::Worker(flags) => strata_engine::serve::worker::run(&flags)?,
        Command::Bench(args) => bench_cmd::run(args)?,
        Command::Device(args) => device_cmd::run(args)?,
        Command::Switches => print!("{}", strata_engine::switches::table()),
        Command::Experts { command } => experts_cmd::run(command)?,
    }
    Ok(())
}

fn report_written(path: &std::path::Path, bytes: u64, start: Instant) {
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "strata: wrote {} ({}) in {secs:.2} s, {:.1} MB/s",
        path.display(),
        human_bytes(bytes),
        bytes as f64 / 1e6 / secs.max(1e-9)
    );
}

fn synth_spec(a: &SynthArgs) -> SynthSpec {
    let mut s = match a.preset {
        Preset::TinyQwen3moe => SynthSpec::tiny_qwen3moe(),
        Preset::Qwen3_30bA3b => SynthSpec::qwen3_30b_a3b(),
    };
    macro_rules! set {
        ($($field:ident = $arg:ident),*) => { $( if let Some(v) = a.$arg { s.$field = v; } )* };
    }
    set!(
        arch = arch,
        n_layer = layers,
        n_embd = embd,
        n_ff = ff,
        n_head = heads,
        n_head_kv = heads_kv
    );
    set!(
        head_dim = head_dim,
        n_expert = experts,
        n_expert_used = experts_used,
        n_ff_exp = ff_exp
    );
    set!(vocab_size = vocab, n_ctx = ctx, zipf = zipf, seed = seed);
    if let Some(ty) = a.ty {
        s.types = strata_engine::fixtures::synth::TensorTypes {
            router: s.types.router,
            ..strata_engine::fixtures::synth::TensorTypes::uniform(ty)
        };
    }
    let t = &mut s.types;
    set_types(t, a);
    s.tied_output |= a.tied_output;
    s.word_fillers |= a.word_fillers;
    s
}

fn set_types(t: &mut strata_engine::fixtures::synth::TensorTypes, a: &SynthArgs) {
    for (slot, arg) in [
        (&mut t.embd, a.type_embd),
        (&mut t.output, a.type_output),
        (&mut t.attn, a.type_attn),
        (&mut t.ffn, a.type_ffn),
        (&mut t.experts, a.type_experts),
        (&mut t.router, a.type_router),
    ] {
        if let Some(ty) = arg {
            *slot = ty;
        }
    }
}
