//! The composition root: the engine flags every command shares ([`EngineFlags`], defined here once) and
//! [`Engine::open`], the one place that assembles an engine from them (worker threads, the device's backend, the
//! fault plan, the model, its tokenizer and chat template). `strata generate`, `chat`, `bench` and the serve worker
//! all open their engine here; sequences ([`Session`]) are then made from it and share its backend and weights.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::backend::{AnyBackend, OpenError};
use crate::device::Device;
use crate::device::fault::{FaultPlan, FaultSpecError};
pub use crate::memory::{PlanFlags, PrefillChunk};
use crate::model::{Model, ModelError};
use crate::models::ModelsError;
use crate::runtime::session::{Session, SessionConfig, SessionError};
use crate::tokenizer::template::TemplateError;
use crate::tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

/// Engine settings shared by `strata generate`, `chat`, `bench`, `serve` and the worker it starts (passed on
/// the worker's command line by [`EngineFlags::to_args`]).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineFlags {
    /// A .gguf file (any shard of a set), `default` for the default model (fetched on first use), or
    /// `synth:NAME` (generated on first use).
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Where to compute: cpu, or cuda:N (all weights resident in VRAM).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// KV cache, context and prefill chunk: what the memory plan is computed from.
    #[command(flatten)]
    pub plan: PlanFlags,
    /// Engine threads, 1 to 1024 (default: all cores).
    #[arg(long, value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// When a library prefill GEMM fails, switch to our own kernel path and keep going (`on`, as llama.cpp
    /// users expect), or fail (`off`, the original Strata's behaviour: the serve worker dies, the front answers
    /// 503 and restarts it).
    #[arg(long, value_enum, default_value = "on")]
    pub gemm_fallback: OnOff,
}

/// A two-state switch spelled `on` or `off` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    /// `true` for `on`.
    pub fn is_on(self) -> bool {
        self == OnOff::On
    }

    fn as_str(self) -> &'static str {
        if self.is_on() { "on" } else { "off" }
    }
}

fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(n),
        _ => Err(format!("--threads takes a thread count from 1 to 1024, not `{s}`")),
    }
}

impl EngineFlags {
    /// `--max-context`, or its default ([`crate::memory::DEFAULT_MAX_CONTEXT`]).
    pub fn max_context(&self) -> usize {
        self.plan.max_context()
    }

    /// The session settings these flags give (the prefill chunk of `auto` when none was given).
    pub fn session_config(&self) -> SessionConfig {
        SessionConfig {
            max_context: self.max_context(),
            kv: self.plan.kv,
            prefill_chunk: self.plan.prefill.and_then(|p| p.0),
        }
    }

    /// The flags as command-line arguments (for `strata worker`): parsing them back gives these flags.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--model".to_string(),
            self.model.clone(),
            "--device".into(),
            self.device.to_string(),
        ];
        a.extend(self.plan.to_args());
        if let Some(t) = self.threads {
            a.extend(["--threads".into(), t.to_string()]);
        }
        a.extend(["--gemm-fallback".into(), self.gemm_fallback.as_str().into()]);
        a
    }
}

/// Why an engine could not be opened; each names the input at fault.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot start the worker threads: {0}")]
    Threads(String),
    #[error(transparent)]
    Fault(#[from] FaultSpecError),
    #[error("cannot use --device {device}: {source}")]
    Device { device: Device, source: OpenError },
    #[error(transparent)]
    Models(#[from] ModelsError),
    #[error("cannot load model {path}: {source}")]
    Model { path: PathBuf, source: ModelError },
    #[error("{path}: tokenizer: {source}")]
    Tokenizer { path: PathBuf, source: TokenizerError },
    #[error("{path}: chat template: {source}")]
    Template { path: PathBuf, source: TemplateError },
}

/// An open engine: the model's weights, tokenizer and chat template, and the backend of its device, shared by
/// every sequence made from it.
pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// The chat template the GGUF declares, if any.
    pub template: Option<ChatTemplate>,
    /// The model file.
    pub path: PathBuf,
    /// Time to load the model (mapping, weight map, tokenizer), ms; the device's start is not included.
    pub load_ms: f64,
    backend: AnyBackend,
    flags: EngineFlags,
    faults: FaultPlan,
}

impl Engine {
    /// Opens the engine `flags` describe: the worker threads, the fault plan (`STRATA_FAULT`), the device first
    /// (a missing GPU is reported before the model is read; a CUDA device logs its start), then the model with a
    /// spinner on a terminal.
    ///
    /// Errors: [`EngineError`], naming the flag, switch or file at fault.
    pub fn open(flags: &EngineFlags) -> Result<Engine, EngineError> {
        crate::backend::cpu::init_threads(flags.threads).map_err(|e| EngineError::Threads(e.to_string()))?;
        let faults = FaultPlan::from_env()?;
        let start = Instant::now();
        let backend = AnyBackend::open(&flags.device).map_err(|source| EngineError::Device {
            device: flags.device.clone(),
            source,
        })?;
        if let Some(c) = backend.cuda() {
            let k = &c.gpu().compile;
            eprintln!(
                "strata: {} ready in {} ms (kernels for {} {} in {:.0} ms)",
                flags.device,
                start.elapsed().as_millis(),
                k.arch,
                if k.cached { "read from the cache" } else { "compiled" },
                k.ms
            );
        }
        let path = crate::models::resolve(Some(&flags.model))?;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_message(format!("loading {}", path.display()));
            b.enable_steady_tick(Duration::from_millis(100));
            b
        });
        let start = Instant::now();
        let loaded = Self::load(&path);
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let (model, tokenizer, template) = loaded?;
        Ok(Engine {
            model,
            tokenizer,
            template,
            load_ms: start.elapsed().as_secs_f64() * 1e3,
            path,
            backend,
            flags: flags.clone(),
            faults,
        })
    }

    fn load(path: &PathBuf) -> Result<(Model, Tokenizer, Option<ChatTemplate>), EngineError> {
        let model = Model::load(path).map_err(|source| EngineError::Model {
            path: path.clone(),
            source,
        })?;
        let md = model.gguf.metadata();
        let tokenizer = Tokenizer::from_metadata(md).map_err(|source| EngineError::Tokenizer {
            path: path.clone(),
            source,
        })?;
        let template = ChatTemplate::from_metadata(md).map_err(|source| EngineError::Template {
            path: path.clone(),
            source,
        })?;
        Ok((model, tokenizer, template))
    }

    /// The backend every sequence of this engine computes on.
    pub fn backend(&self) -> &AnyBackend {
        &self.backend
    }

    /// The flags the engine was opened with.
    pub fn flags(&self) -> &EngineFlags {
        &self.flags
    }

    /// A new sequence with the flags' settings.
    ///
    /// Errors: as [`Session::new`].
    pub fn session(&self) -> Result<Session<'_, AnyBackend>, SessionError> {
        self.session_with(self.flags.session_config())
    }

    /// A new sequence with `config` (the engine's fault plan and `--gemm-fallback` applied).
    ///
    /// Errors: as [`Session::new`].
    pub fn session_with(&self, config: SessionConfig) -> Result<Session<'_, AnyBackend>, SessionError> {
        let mut s = Session::new(&self.model, &self.backend, config)?;
        s.set_fault_policy(self.faults, self.flags.gemm_fallback.is_on());
        Ok(s)
    }

    /// The one-line summary of what was loaded: `loaded PATH (llama, 30 layers) in 98 ms`.
    pub fn loaded_line(&self) -> String {
        format!(
            "loaded {} ({}, {} layers) in {:.0} ms",
            self.path.display(),
            self.model.hp.arch,
            self.model.hp.n_layer,
            self.load_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        flags: EngineFlags,
    }

    #[test]
    fn worker_arguments_parse_back_to_the_same_flags() {
        for args in [
            vec!["x"],
            vec![
                "x",
                "--model",
                "m.gguf",
                "--device",
                "sim:h200",
                "--kv",
                "int8",
                "--max-context",
                "77",
                "--prefill",
                "auto",
                "--threads",
                "3",
                "--gemm-fallback",
                "off",
            ],
            vec!["x", "--prefill", "64"],
        ] {
            let a = Cli::parse_from(&args).flags;
            let back = Cli::parse_from(std::iter::once("x".to_string()).chain(a.to_args())).flags;
            assert_eq!(format!("{a:?}"), format!("{back:?}"), "{args:?}");
        }
        for (flag, v) in [
            ("--prefill", "0"),
            ("--max-context", "0"),
            ("--threads", "0"),
            ("--threads", "100000"),
        ] {
            let bad = Cli::try_parse_from(["x", flag, v]).err().unwrap().to_string();
            assert!(bad.contains(flag), "{bad}");
        }
    }

    #[test]
    fn a_sim_device_is_refused_by_name_before_the_model_is_read() {
        let flags = Cli::parse_from(["x", "--device", "sim:gfx1100-rx7900xtx", "--model", "/nonexistent.gguf"]).flags;
        let e = Engine::open(&flags).err().unwrap().to_string();
        assert!(
            e.contains("--device sim:gfx1100-rx7900xtx") && e.contains("not implemented"),
            "{e}"
        );
    }
}
