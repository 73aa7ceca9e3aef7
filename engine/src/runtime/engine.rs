//! The composition root: the engine flags every command shares ([`EngineFlags`], defined here once) and
//! [`Engine::open`], the one place that assembles an engine from them (worker threads, the device's backend, the
//! fault plan, the model, its tokenizer and chat template). `strata generate`, `chat`, `bench` and the serve worker
//! all open their engine here; sequences ([`Session`]) are then made from it and share its backend and weights.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::experts::{ExpertCacheConfig, HostPin};
use crate::backend::{AnyBackend, OpenError};
use crate::device::Device;
use crate::device::fault::{FaultPlan, FaultSpecError};
use crate::experts::cache::Policy;
use crate::experts::miss::{MissCost, MissPlan, MissPolicy};
use crate::experts::profile::ExpertProfile;
use crate::experts::store::host_available_bytes;
use crate::experts::trace::{RoutingReplay, RoutingSource};
use crate::memory::{
    CacheSize, ExpertFlags, ExpertPlacement, MemoryPlan, PlanConfig, Verdict, WeightBytes, human_bytes,
};
pub use crate::memory::{PlanFlags, PrefillChunk};
use crate::model::{Model, ModelError};
use crate::models::ModelsError;
use crate::runtime::session::{Session, SessionConfig, SessionError};
use crate::state::kv::KvPool;
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
    /// Where to compute: cpu, or cuda:N (dense weights and KV in VRAM; experts too when they fit, else a VRAM
    /// expert cache over experts in host memory).
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
    /// Write every forward step's routing to this file as a routing trace (JSON Lines: for `strata experts
    /// simulate`, or `--routing-trace` elsewhere), appending when it holds a trace of this model's geometry. MoE
    /// models only; on a GPU each MoE layer then reads its routing back, so decode runs without CUDA graphs.
    #[arg(long)]
    pub dump_routing: Option<PathBuf>,
    /// With a device list (`--device cuda:0,cuda:1`): how the model's layers are split over the devices, `auto`
    /// (in proportion to what each card may hold once the embeddings and the output head are placed) or one layer
    /// count per device (`24,24`).
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<crate::memory::split::LayerSplit>())]
    pub layer_split: crate::memory::split::LayerSplit,
    /// Batch-invariant kernels: a sequence gets the same logits bits, hence tokens, alone and inside any batch of
    /// `strata serve`, on a GPU too (every step's tokens take the kernels of a lone decode step, whose arithmetic
    /// for one token does not depend on the others'; prompts read slower). The CPU's kernels are batch-invariant
    /// already. Not with an expert cache, --dump-routing or --routing-trace on a GPU.
    #[arg(long)]
    pub batch_invariant: bool,
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

    /// `--layer-split` needs a device list, and a split does not yet take the flags that read one card's expert
    /// cache whole (the expert profiles) or `--batch-invariant`.
    ///
    /// Errors: [`EngineError::Plan`] naming the flag.
    pub fn check_split(&self) -> Result<(), EngineError> {
        let refuse = |why: String| {
            Err(EngineError::Plan {
                device: self.device.clone(),
                why,
            })
        };
        let Device::Split(_) = self.device else {
            if self.layer_split != crate::memory::split::LayerSplit::Auto {
                return refuse(format!(
                    "--layer-split {} splits layers over several devices: name them (--device cuda:0,cuda:1)",
                    self.layer_split
                ));
            }
            return Ok(());
        };
        let ef = &self.plan.experts;
        let flag = if self.batch_invariant {
            Some("--batch-invariant")
        } else if ef.expert_profile.is_some() {
            Some("--expert-profile")
        } else if ef.save_expert_profile.is_some() {
            Some("--save-expert-profile")
        } else if ef.expert_policy == Policy::Profile {
            Some("--expert-policy profile")
        } else {
            None
        };
        match flag {
            Some(f) => refuse(format!(
                "{f} is not available with a layer split yet: use one device (--device cuda:N)"
            )),
            None => Ok(()),
        }
    }

    /// `--routing-trace` needs a CUDA device.
    ///
    /// Errors: [`EngineError::Plan`] naming the flag and the device.
    pub fn check_routing_device(&self) -> Result<(), EngineError> {
        if self.plan.experts.routing_trace.is_some() && !self.device.is_cuda() {
            return Err(EngineError::Plan {
                device: self.device.clone(),
                why: "--routing-trace drives a GPU's routers: use --device cuda:N".into(),
            });
        }
        Ok(())
    }

    /// `--expert-policy profile` needs `--expert-profile`; `--save-expert-profile` needs a GPU (the CPU has no
    /// expert cache to learn from).
    ///
    /// Errors: [`EngineError::ExpertProfile`] naming the flags.
    pub fn check_expert_flags(&self) -> Result<(), EngineError> {
        let ef = &self.plan.experts;
        if ef.expert_policy == Policy::Profile && ef.expert_profile.is_none() {
            return Err(EngineError::ExpertProfile {
                flag: "--expert-policy profile",
                path: None,
                why: "needs --expert-profile FILE (its experts fill the slots, which then stay)".into(),
            });
        }
        if let Some(p) = &ef.save_expert_profile
            && !matches!(self.device, Device::Cuda(_))
        {
            return Err(EngineError::ExpertProfile {
                flag: "--save-expert-profile",
                path: Some(p.clone()),
                why: format!("{NO_CACHE_TO_LEARN} (--device {})", self.device),
            });
        }
        Ok(())
    }

    /// What `strata serve` checks before it starts a worker, so a bad `--routing-trace`, expert profile, profile
    /// to save or `--dump-routing` file is one error, not a worker restarted for ever: the device they need, and
    /// each file read and matched against the model at `model`. Returns the `--routing-trace` replay it built
    /// (read or generated once: the engine uses it).
    ///
    /// Errors: as [`EngineFlags::check_routing_device`] and [`EngineFlags::check_expert_flags`];
    /// [`EngineError::RoutingTrace`], [`EngineError::ExpertProfile`], [`EngineError::DumpRouting`]; the model
    /// cannot be read.
    pub fn check_routing_trace(&self, model: &std::path::Path) -> Result<Option<RoutingReplay>, EngineError> {
        self.check_split()?;
        self.check_batch_invariant()?;
        self.check_routing_device()?;
        self.check_expert_flags()?;
        let ef = &self.plan.experts;
        let split_counts = matches!(self.layer_split, crate::memory::split::LayerSplit::Counts(_));
        if ef.routing_trace.is_none()
            && ef.expert_profile.is_none()
            && ef.save_expert_profile.is_none()
            && self.dump_routing.is_none()
            && !split_counts
        {
            return Ok(None);
        }
        let unreadable = |source: ModelError| EngineError::Model {
            path: model.to_path_buf(),
            source,
        };
        let gguf = crate::gguf::GgufModel::open(model).map_err(|e| unreadable(e.into()))?;
        let hp = crate::model::HParams::from_metadata(gguf.metadata()).map_err(|source| {
            unreadable(ModelError::HParams {
                file: model.display().to_string(),
                source,
            })
        })?;
        if let Device::Split(ords) = &self.device {
            // Counts that do not add up to the model's layers: refused here, before a server's worker starts.
            self.layer_split
                .ranges(hp.n_layer as usize, &vec![1; ords.len()])
                .map_err(|why| EngineError::Plan {
                    device: self.device.clone(),
                    why,
                })?;
        }
        let replay = ef.routing_trace.as_ref().map(|t| replay_for(t, &hp)).transpose()?;
        if let Some(p) = &ef.expert_profile {
            read_profile(p, &hp)?;
        }
        if let Some(p) = &ef.save_expert_profile {
            saved_profile(p, &hp)?;
        }
        if let Some(p) = &self.dump_routing {
            // Opened and closed again: the worker opens it for good (a file that was not there is left as a
            // trace with no records, which the worker appends to).
            drop(routing_writer(p, &hp, self)?);
        }
        Ok(replay)
    }

    /// `--batch-invariant` with a flag whose routing it cannot keep invariant: `--dump-routing` (it reads a step's
    /// routing back whole, which batch-invariant steps route in groups) or `--routing-trace` (its experts follow
    /// the order of the steps' tokens, not each token's own).
    ///
    /// Errors: [`EngineError::Plan`] naming both flags.
    pub fn check_batch_invariant(&self) -> Result<(), EngineError> {
        let with = match (&self.dump_routing, &self.plan.experts.routing_trace) {
            // The CPU's kernels are invariant already: the flag changes nothing there.
            _ if !self.batch_invariant || !matches!(self.device, Device::Cuda(_)) => return Ok(()),
            (Some(_), _) => {
                "--dump-routing (it reads a step's routing back whole; batch-invariant steps route their experts in groups)"
            }
            (None, Some(_)) => {
                "--routing-trace (a trace's experts follow the order of the steps' tokens, so they depend on the batch)"
            }
            (None, None) => return Ok(()),
        };
        Err(EngineError::Plan {
            device: self.device.clone(),
            why: format!("--batch-invariant cannot be used with {with}"),
        })
    }

    /// The flags as command-line arguments (for `strata worker`): parsing them back gives these flags.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--model".to_string(),
            self.model.clone(),
            "--device".into(),
            self.device.to_string(),
            "--layer-split".into(),
            self.layer_split.to_string(),
        ];
        a.extend(self.plan.to_args());
        if let Some(t) = self.threads {
            a.extend(["--threads".into(), t.to_string()]);
        }
        a.extend(["--gemm-fallback".into(), self.gemm_fallback.as_str().into()]);
        if let Some(p) = &self.dump_routing {
            a.extend(["--dump-routing".into(), p.display().to_string()]);
        }
        if self.batch_invariant {
            a.push("--batch-invariant".into());
        }
        a
    }
}

/// `--batch-invariant`: turned on for a GPU ([`crate::backend::cuda::CudaBackend::set_batch_invariant`]) with a
/// line saying what it costs; on the CPU (and a `sim:` device, whose arithmetic is the CPU's) a line saying the
/// kernels already are.
///
/// Errors: [`EngineError::Plan`] when the GPU keeps an expert cache (misses the CPU computes take the CPU's
/// arithmetic), or the model's heads are wider than the decode attention kernel stages (keys over 512 values,
/// values over 256). (The flags it cannot be used with were checked: [`EngineFlags::check_batch_invariant`].)
fn batch_invariant(backend: &AnyBackend, flags: &EngineFlags, hp: &crate::model::HParams) -> Result<(), EngineError> {
    if !flags.batch_invariant {
        return Ok(());
    }
    let Some(c) = backend.cuda() else {
        eprintln!(
            "strata: --batch-invariant: {}'s kernels are batch-invariant already (each token's dot products in one order, whatever the batch): nothing changes",
            flags.device
        );
        return Ok(());
    };
    let refuse = |why: String| EngineError::Plan {
        device: flags.device.clone(),
        why: format!("--batch-invariant {why}"),
    };
    if let Some(cfg) = c.expert_cache_config() {
        return Err(refuse(format!(
            "needs every expert in VRAM, and this model's experts go through an expert cache of {} slots (misses the CPU computes take its arithmetic, not the GPU's): leave out --batch-invariant, or give the card room for every expert",
            cfg.slots
        )));
    }
    let (dk, dv) = (hp.head_dim as usize, hp.head_dim_v as usize);
    let (max_dk, max_dv) = (crate::backend::cuda::DECODE_MAX_DK, crate::backend::cuda::DECODE_MAX_DV);
    if dk > max_dk || dv > max_dv {
        return Err(refuse(format!(
            "needs heads its decode attention kernel stages whole (keys of at most {max_dk} values, values of at most {max_dv}); this model's are {dk} and {dv}"
        )));
    }
    c.set_batch_invariant(true);
    eprintln!(
        "strata: --batch-invariant: every step's tokens take a lone decode step's kernels (matrix-vector products, each query's attention over its keys in order), so a sequence's logits are the same bits alone and in any batch; prompts read slower than with the GEMM and tensor-core attention"
    );
    Ok(())
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
    #[error("--dump-routing {path}: {why}")]
    DumpRouting { path: PathBuf, why: String },
    #[error("--routing-trace {spec}: {why}")]
    RoutingTrace { spec: RoutingSource, why: String },
    /// `--expert-profile`, `--save-expert-profile` or `--expert-policy profile` (`flag`) cannot be used.
    #[error("{flag}{}: {why}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    ExpertProfile {
        flag: &'static str,
        path: Option<PathBuf>,
        why: String,
    },
    /// The memory plan does not fit the device, or a part of it could not be allocated (`why` ends with the plan).
    #[error("--device {device}: {why}")]
    Plan { device: Device, why: String },
    /// A `STRATA_FAULT` rule the device cannot carry out (a kernel it does not have, a trap on a simulated device).
    #[error("{}: {why}", crate::switches::FAULT)]
    FaultRule { why: String },
}

/// An open engine: the model's weights, tokenizer and chat template, and the backend of its device, shared by
/// every sequence made from it.
pub struct Engine {
    /// The expert arena's page lock: first, so it is released before the model frees the arena.
    pinned: Option<HostPin>,
    /// A simulated device's account and allocations (`--device sim:PROFILE`), held so they are freed when the
    /// engine is dropped.
    _sim: Option<crate::runtime::sim::SimHold>,
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// The chat template the GGUF declares, if any.
    pub template: Option<ChatTemplate>,
    /// The model file.
    pub path: PathBuf,
    /// Time to load the model (mapping, weight map, tokenizer), ms; the device's start is not included.
    pub load_ms: f64,
    /// The speed switches of its device as the start line gave them ([`crate::switches::SpeedReport`]).
    pub speed_switches: String,
    backend: AnyBackend,
    flags: EngineFlags,
    faults: FaultPlan,
    /// `--save-expert-profile`: the file, and the counts it held at start (the cache's lookups add to them).
    saver: Option<(PathBuf, ExpertProfile)>,
    /// The KV blocks every sequence of the engine takes from (`--kv-tokens`).
    kv_pool: Arc<KvPool>,
}

impl Engine {
    /// Opens the engine `flags` describe: the worker threads, the fault plan (`STRATA_FAULT`), the device first
    /// (a missing GPU is reported before the model is read; a CUDA device logs its start), then the model with a
    /// spinner on a terminal.
    ///
    /// Errors: [`EngineError`], naming the flag, switch or file at fault.
    pub fn open(flags: &EngineFlags) -> Result<Engine, EngineError> {
        crate::backend::cpu::init_threads(flags.threads).map_err(|e| EngineError::Threads(e.to_string()))?;
        let mut faults = FaultPlan::from_env()?;
        if flags.plan.experts.cache_sizing != crate::memory::CacheSizing::Plan
            && !matches!(flags.device, Device::Sim(_))
        {
            return Err(EngineError::Plan {
                device: flags.device.clone(),
                why: "--cache-sizing original reproduces the original Strata's sizing on a simulated device: use --device sim:PROFILE".into(),
            });
        }
        // The split's flags are checked before a card is opened.
        flags.check_split()?;
        let start = Instant::now();
        let mut backend = AnyBackend::open(&flags.device).map_err(|source| EngineError::Device {
            device: flags.device.clone(),
            source,
        })?;
        for c in backend.cudas() {
            let k = &c.gpu().compile;
            eprintln!(
                "strata: {} ready in {} ms (kernels for {} {} in {:.0} ms)",
                Device::Cuda(c.gpu().ctx.ordinal()),
                start.elapsed().as_millis(),
                k.arch,
                if k.cached { "read from the cache" } else { "compiled" },
                k.ms
            );
        }
        flags.check_routing_device()?;
        flags.check_expert_flags()?;
        if backend.cudas().is_empty()
            && !matches!(flags.device, Device::Sim(_))
            && flags.plan.experts != ExpertFlags::default()
        {
            eprintln!(
                "strata: the expert cache's flags apply to a GPU: on {} every expert is read where the model file keeps it",
                flags.device
            );
        }
        let path = crate::models::resolve(Some(&flags.model))?;
        // The routing trace, profiles and dump file against the model's header, before the weights load (a
        // dense model or a trace of another geometry is an error in seconds, not after a 17 GB upload).
        let replay = flags.check_routing_trace(&path)?;
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
        let (mut model, tokenizer, template) = loaded?;
        if backend.cudas().is_empty()
            && crate::switches::speed_on(crate::switches::CPU_PACK, &crate::switches::Target::host())
        {
            let t = Instant::now();
            // The packed copies are the process's own memory (the file's pages are released): at most half of
            // what the host has available, so the KV cache and everything else keep room.
            let available = host_available_bytes();
            match model.pack_for_cpu(available.map(|a| a / 2)) {
                Ok((n, bytes)) if n > 0 => eprintln!(
                    "strata: {n} matrices packed eight rows at a time for the CPU's int8 matmul ({:.1} MiB in {:.0} ms; {}=0 reads them in the file's layout)",
                    bytes as f64 / (1u64 << 20) as f64,
                    t.elapsed().as_secs_f64() * 1e3,
                    crate::switches::CPU_PACK
                ),
                Ok(_) => {}
                Err(need) => eprintln!(
                    "strata: the CPU reads the matrices in the file's layout: packing them ({}) would take {:.2} GiB, more than half of the {:.2} GiB of host memory available",
                    crate::switches::CPU_PACK,
                    need as f64 / GIB,
                    available.unwrap_or(0) as f64 / GIB
                ),
            }
        }
        let load_ms = start.elapsed().as_secs_f64() * 1e3;
        let parts = place_split(&mut backend, &model, flags)?;
        let kv_pool = kv_pool(&model, flags, crate::backend::Backend::kv_on_device(&backend))?;
        if backend.cudas().is_empty() {
            check_host_kv(&model, flags, &kv_pool)?;
        }
        let mut pinned = None;
        if let Some(split) = backend.split() {
            for (st, part) in split.stages().iter().zip(&parts) {
                let c = st.be.cuda().expect("a split's stages are CUDA backends");
                plan_device(c, &mut model, flags, &faults, &kv_pool, part, &mut pinned)?;
            }
        } else if let Some(c) = backend.cuda() {
            let whole = DevicePart::whole(&flags.device, model.hp.n_layer as usize);
            plan_device(c, &mut model, flags, &faults, &kv_pool, &whole, &mut pinned)?;
        }
        batch_invariant(&backend, flags, &model.hp)?;
        let sim = match &flags.device {
            Device::Sim(name) => {
                let hold = crate::runtime::sim::open(name, &mut model, flags)?;
                faults = sim_faults(faults, &hold, flags)?;
                Some(hold)
            }
            _ => None,
        };
        let target = match (backend.cudas().first(), &sim) {
            (Some(c), _) => c.gpu().target.clone(),
            // A simulated card's arithmetic is the CPU backend's: its own arch's switches do not apply.
            (None, Some(hold)) => crate::switches::Target::Cpu {
                arch: format!("{} ({}, arithmetic on the CPU)", hold.device.profile.arch, flags.device),
            },
            (None, None) => crate::switches::Target::host(),
        };
        let speed_switches = crate::switches::SpeedReport::of(&target).to_string();
        eprintln!("strata: {speed_switches}");
        if faults.probe_unsynced && backend.cudas().is_empty() {
            return Err(EngineError::FaultRule {
                why: format!(
                    "probe:unsynced: the link probe that times copies it did not wait for is a CUDA device's; {} has none (a sim: profile's link.probe_gb_s gives its readings)",
                    flags.device
                ),
            });
        }
        if let Some(rule) = &faults.sticky {
            let error = match &sim {
                Some(hold) => hold.device.profile.api.launch_failure(),
                None => "",
            };
            let synced = backend
                .arm_sticky(&flags.device, rule, error)
                .map_err(|why| EngineError::FaultRule { why })?;
            eprintln!(
                "strata: {}={rule}: launch {} of {} on {} {}; {}",
                crate::switches::FAULT,
                rule.launch,
                rule.kernel,
                flags.device,
                if rule.trap {
                    "runs a trap instruction in its place (a real poisoned context)"
                } else {
                    "fails and every call after it fails"
                },
                if synced {
                    "launches are synchronised (STRATA_SYNC_LAUNCHES=1): the fault names its kernel"
                } else {
                    "launches are not synchronised: the failure surfaces at a later call"
                }
            );
        }
        let cache = backend.cuda().filter(|c| c.expert_cache_config().is_some());
        if let Some(p) = &flags.plan.experts.expert_profile {
            let profile = read_profile(p, &model.hp)?;
            match cache {
                Some(c) => prefill_from(c, &model, p, &profile)?,
                // On a CPU the line above said the expert flags do nothing.
                None if backend.cuda().is_none() => {}
                None => eprintln!(
                    "strata: --expert-profile {}: every expert is resident on {}, nothing to pre-fill",
                    p.display(),
                    flags.device
                ),
            }
        }
        let saver = match &flags.plan.experts.save_expert_profile {
            Some(p) => {
                let base = saved_profile(p, &model.hp)?;
                let bad = |why: String| EngineError::ExpertProfile {
                    flag: "--save-expert-profile",
                    path: Some(p.clone()),
                    why,
                };
                if cache.is_none() {
                    return Err(bad(format!(
                        "{NO_CACHE_TO_LEARN}: every expert of the model is resident on {}",
                        flags.device
                    )));
                }
                base.write(p).map_err(|e| bad(format!("cannot write it: {e}")))?;
                eprintln!(
                    "strata: the expert cache's lookups saved to {} after every request (--save-expert-profile{})",
                    p.display(),
                    if base.total() > 0 { ", adding to its counts" } else { "" }
                );
                Some((p.clone(), base))
            }
            None => None,
        };
        if let Some(p) = &flags.dump_routing {
            model.dump_routing(routing_writer(p, &model.hp, flags)?);
            eprintln!("strata: routing written to {} (--dump-routing)", p.display());
        }
        if let (Some(t), Some(replay)) = (&flags.plan.experts.routing_trace, replay) {
            // Each stage keeps its own copy: a replay's cursors are per layer.
            for c in backend.cudas() {
                c.set_routing_replay(Some(replay.clone()));
            }
            eprintln!("strata: routing from {t} (--routing-trace): the tokens are not the model's");
        }
        Ok(Engine {
            pinned,
            _sim: sim,
            model,
            tokenizer,
            template,
            load_ms,
            speed_switches,
            path,
            backend,
            flags: flags.clone(),
            faults,
            saver,
            kv_pool,
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

    /// Whether the routed experts are in a page-locked host arena (the expert cache uploads from it).
    pub fn arena_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// The end of a command that was asked for `--dump-routing`: an error when a write failed and the trace was
    /// cut short (the failure was said when it happened; the command's exit status says it again).
    ///
    /// Errors: [`EngineError::DumpRouting`] with the write error.
    pub fn check_routing_dump(&self) -> Result<(), EngineError> {
        match (&self.flags.dump_routing, self.model.routing_dump_error()) {
            (Some(path), Some(e)) => Err(EngineError::DumpRouting {
                path: path.clone(),
                why: format!("the routing was not all written ({e})"),
            }),
            _ => Ok(()),
        }
    }

    /// Writes the learned expert profile (`--save-expert-profile`): the file's counts at start plus the cache's
    /// lookups since. A write that fails is one line on stderr; the next request's write tries again.
    pub fn save_expert_profile(&self) {
        let (Some((path, base)), Some(c)) = (&self.saver, self.backend.cuda()) else {
            return;
        };
        let Some(lookups) = c.expert_lookups() else { return };
        let mut p = base.clone();
        p.add(&lookups);
        if let Err(e) = p.write(path) {
            eprintln!("strata: --save-expert-profile {}: cannot write it: {e}", path.display());
        }
    }

    /// What the expert cache did since the last call (or [`Engine::emit_expert_cache`]), its counts zeroed;
    /// `None` without a cache. A split's stages each cache their own layers' experts: their counts add up.
    pub fn take_expert_cache_stats(&self) -> Option<crate::backend::cuda::experts::ExpertCacheStats> {
        Self::sum_stages(&self.take_expert_cache_stages())
    }

    /// [`Engine::take_expert_cache_stats`] by cache: on a layer split, each stage's with its label (`cuda:1
    /// (layers 24-47)`); on one card, its one cache with an empty label; empty without a cache.
    pub fn take_expert_cache_stages(&self) -> Vec<(String, crate::backend::cuda::experts::ExpertCacheStats)> {
        match self.backend.split() {
            Some(split) => split
                .stages()
                .iter()
                .filter_map(|st| {
                    let stats = st.be.cuda()?.take_expert_cache_stats()?;
                    Some((crate::memory::split::stage_label(&st.device, &st.layers), stats))
                })
                .collect(),
            None => self
                .backend
                .cudas()
                .iter()
                .filter_map(|c| c.take_expert_cache_stats())
                .map(|s| (String::new(), s))
                .collect(),
        }
    }

    /// The caches' counts added up (`None` without a cache).
    fn sum_stages(
        stages: &[(String, crate::backend::cuda::experts::ExpertCacheStats)],
    ) -> Option<crate::backend::cuda::experts::ExpertCacheStats> {
        stages.iter().map(|(_, s)| *s).reduce(|mut a, b| {
            a.add(&b);
            a
        })
    }

    /// Emits what the expert cache did since the last call (one `expert_cache` event per phase that looked an
    /// expert up, for `request`), zeroes its counts, and saves the learned profile (`--save-expert-profile`);
    /// nothing without a cache.
    pub fn emit_expert_cache(&self, request: Option<u64>) {
        self.save_expert_profile();
        let stages = self.take_expert_cache_stages();
        let Some(st) = Self::sum_stages(&stages) else {
            return;
        };
        for (phase, p) in [("prefill", st.prefill), ("decode", st.decode)] {
            if p.cache.lookups == 0 {
                continue;
            }
            let of_phase = |s: &crate::backend::cuda::experts::ExpertCacheStats| {
                if phase == "prefill" { s.prefill } else { s.decode }
            };
            let per_stage = if self.backend.split().is_some() {
                stages
                    .iter()
                    .map(|(label, s)| {
                        let q = of_phase(s);
                        crate::events::StageCache {
                            stage: label.clone(),
                            lookups: q.cache.lookups,
                            hits: q.cache.hits,
                            bytes_uploaded: q.bytes_uploaded,
                            cpu_computed: q.cpu_computed,
                        }
                    })
                    .collect()
            } else {
                Vec::new()
            };
            crate::events::emit(crate::events::EventKind::ExpertCache(crate::events::ExpertCache {
                request,
                phase: phase.into(),
                lookups: p.cache.lookups,
                hits: p.cache.hits,
                admitted: p.cache.admitted,
                staged: p.cache.bypassed.saturating_sub(p.cpu_computed),
                cpu_computed: p.cpu_computed,
                prefetched: p.prefetched,
                prefetch_used: p.prefetch_used,
                evictions: p.cache.evictions,
                bytes_uploaded: p.bytes_uploaded,
                stages: per_stage,
            }));
        }
    }

    /// The KV blocks the engine's sequences take from ([`Engine::session`]'s caches; `--kv-tokens`).
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.kv_pool
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
        let free = || {
            self.backend
                .cuda()
                .and_then(|c| c.gpu().mem_info().ok())
                .map(|(f, _)| f)
        };
        let before = free();
        let mut s = Session::new_in(&self.model, &self.backend, config, &self.kv_pool)?;
        if let (Some(c), Some(before), Some(after)) = (self.backend.cuda(), before, free()) {
            cuda_memory(
                c,
                &self.flags.device,
                "a sequence's buffers",
                before.saturating_sub(after) as u64,
                false,
            );
        }
        s.set_fault_policy(self.faults.clone(), self.flags.gemm_fallback.is_on());
        Ok(s)
    }

    /// Starts a thread that reads the device's memory every `period` and emits a `memory` event of op `reading`
    /// (what: `device memory`, bytes: in use) at once and then whenever the free memory changed, until the
    /// returned guard is dropped (a reading holds until the next: an idle device adds no events); on a layer split,
    /// each card's, named by its card. `None` on the CPU (no device memory). The harness draws these over time
    /// beside the host's memory (DESIGN.md section 3, "Device profiles"; issue 17 point 7). A reading that fails
    /// (a CUDA context a fault poisoned) ends the thread.
    pub fn memory_readings(&self, period: Duration) -> Option<MemoryReadings> {
        type Read = Box<dyn Fn() -> Option<(u64, u64, f64)> + Send>;
        let cuda = |c: &CudaBackend| -> Read {
            let ctx = c.gpu().ctx.clone();
            Box::new(move || ctx.mem_get_info().ok().map(|(f, t)| (f as u64, t as u64, 1.0)))
        };
        // One reader per card: a layer split's cards each (a card named twice read once).
        let mut cards: Vec<(String, Read)> = Vec::new();
        if self.backend.split().is_some() {
            for c in self.backend.cudas() {
                let name = Device::Cuda(c.gpu().ctx.ordinal()).to_string();
                if !cards.iter().any(|(n, _)| *n == name) {
                    cards.push((name, cuda(c)));
                }
            }
        } else {
            match (self.backend.cuda(), &self._sim) {
                (Some(c), _) => cards.push((self.flags.device.to_string(), cuda(c))),
                (None, Some(hold)) => {
                    let dev = hold.device.clone();
                    cards.push((
                        self.flags.device.to_string(),
                        Box::new(move || {
                            let (f, t) = dev.mem_info();
                            Some((f, t, dev.scale()))
                        }),
                    ));
                }
                (None, None) => {}
            }
        }
        let emit = move |device: &str, (free, total, scale): (u64, u64, f64)| {
            crate::events::emit(crate::events::EventKind::Memory(crate::events::Memory {
                device: device.to_string(),
                op: "reading".into(),
                what: "device memory".into(),
                bytes: total.saturating_sub(free),
                host: false,
                free_bytes: free,
                total_bytes: total,
                scale,
            }));
        };
        // The first readings here, before any request can run (a worker a fault kills still has them).
        let mut last = Vec::with_capacity(cards.len());
        for (name, read) in &cards {
            let r = read()?;
            emit(name, r);
            last.push(r.0);
        }
        if cards.is_empty() {
            return None;
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = std::thread::spawn(move || {
            loop {
                std::thread::park_timeout(period);
                if stop2.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                for ((name, read), last) in cards.iter().zip(last.iter_mut()) {
                    let Some(r) = read() else { return };
                    if r.0 != *last {
                        emit(name, r);
                        *last = r.0;
                    }
                }
            }
        });
        Some(MemoryReadings {
            stop,
            handle: Some(handle),
        })
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

impl Drop for Engine {
    /// Drains the device's stream first: expert uploads may still read the arena the model frees.
    fn drop(&mut self) {
        self.save_expert_profile();
        for c in self.backend.cudas() {
            let _ = c.synchronize();
        }
    }
}

/// The part of the model one CUDA backend computes: every layer, or a stage's of a layer split.
struct DevicePart {
    /// The card.
    device: Device,
    /// The part as messages name it (`cuda:1`; a stage of a split: `cuda:1 (layers 24-47)`).
    label: String,
    layers: std::ops::Range<usize>,
    /// Whether this is the whole model on one card (no split).
    whole: bool,
    /// Its fraction of the card's free memory and `--vram-budget`: `(its layers, the layers of every stage on
    /// the card)`; `(1, 1)` for a card of its own.
    share: (u64, u64),
    /// A split stage's card's free memory in bytes, read once before any stage allocated (stages on one card are
    /// planned before the first one's experts are uploaded, so what a later one reads would count memory the
    /// earlier one is about to take); `None`: read it when the part is planned.
    card_free: Option<u64>,
}

impl DevicePart {
    fn whole(device: &Device, n_layer: usize) -> DevicePart {
        DevicePart {
            device: device.clone(),
            label: device.to_string(),
            layers: 0..n_layer,
            whole: true,
            share: (1, 1),
            card_free: None,
        }
    }
}

/// Places a layer split's stages (`--layer-split`, or `auto` from what each card may hold) and says how.
///
/// Errors: [`EngineError::Plan`] for a split the model cannot take (counts that do not add up, fewer layers than
/// devices) or a card whose free memory cannot be read.
fn place_split(backend: &mut AnyBackend, model: &Model, flags: &EngineFlags) -> Result<Vec<DevicePart>, EngineError> {
    let Some(split) = backend.split_mut() else {
        return Ok(Vec::new());
    };
    let device = &flags.device;
    let err = |why: String| EngineError::Plan {
        device: device.clone(),
        why,
    };
    let ords: Vec<usize> = match device {
        Device::Split(o) => o.clone(),
        _ => unreachable!("a split backend is opened for a split device"),
    };
    let mut card_free = Vec::with_capacity(ords.len());
    for st in split.stages() {
        let c = st.be.cuda().expect("a split's stages are CUDA backends");
        let (free, _) = c
            .gpu()
            .mem_info()
            .map_err(|e| err(format!("{}: cannot read the free device memory: {e}", st.device)))?;
        card_free.push(free as u64);
    }
    let config = PlanConfig::from_flags(&flags.plan, model.hp.n_ctx_train);
    let stages = crate::memory::split::place(&model.gguf, &model.hp, &ords, &card_free, &config, &flags.layer_split)
        .map_err(err)?;
    let ranges: Vec<_> = stages.iter().map(|s| s.layers.clone()).collect();
    split.place(&ranges);
    let parts: Vec<DevicePart> = stages
        .into_iter()
        .enumerate()
        .map(|(i, s)| DevicePart {
            device: Device::Cuda(s.ord),
            label: crate::memory::split::stage_label(&Device::Cuda(s.ord), &s.layers),
            layers: s.layers,
            whole: false,
            share: s.share,
            card_free: Some(card_free[i]),
        })
        .collect();
    eprintln!(
        "strata: layer split over {device} ({}): {}",
        flags.layer_split.how(),
        parts
            .iter()
            .map(|p| format!("{} {} layers", p.label, p.layers.len()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Each boundary: how the hidden state and its norm (one token's, in decode) cross, and what a crossing took.
    let split = backend.split().expect("a split backend");
    let bytes = 2 * model.hp.n_embd as usize * 4;
    let times = split.measure_links(bytes).unwrap_or_else(|e| {
        eprintln!("strata: layer split: the crossings between stages were not measured ({e})");
        vec![None; parts.len().saturating_sub(1)]
    });
    for (i, t) in times.iter().enumerate() {
        let how = match (split.link(i + 1), t) {
            (Some(link), Some(t)) => format!("{link}, {:.1} us a crossing of {} KiB", t * 1e6, bytes / 1024),
            (Some(link), None) => link.to_string(),
            (None, _) => "through host memory (a download, then an upload)".to_string(),
        };
        eprintln!(
            "strata: layer split: {} -> {}: {how}",
            parts[i].label,
            parts[i + 1].label
        );
    }
    Ok(parts)
}

/// Sizes a CUDA device's memory from the plan (DESIGN.md section 3, "Memory plan"), logging it as the original
/// Strata does: every expert resident when they fit, else the expert cache over the host store (the page-locked
/// arena, or the mapped GGUF with `--mmap-experts` or when the arena cannot be made); then the dense weights are
/// copied and the free memory left is logged. `part`: the whole model, or one stage of a layer split (its layers,
/// its share of the card); `pinned`: the arena's page lock, made here by the first part that needs the arena.
///
/// Errors: [`EngineError::Plan`] when the plan does not fit (before anything is allocated) or an allocation of it
/// fails, naming the part and the numbers.
fn plan_device(
    c: &CudaBackend,
    model: &mut Model,
    flags: &EngineFlags,
    faults: &FaultPlan,
    kv_pool: &Arc<KvPool>,
    part: &DevicePart,
    pinned: &mut Option<HostPin>,
) -> Result<(), EngineError> {
    let device = flags.device.clone();
    let fail = |why: String, plan: &MemoryPlan| EngineError::Plan {
        device: device.clone(),
        why: format!("{}{why}\nmemory plan:\n{}", stage_prefix(part), plan.to_text()),
    };
    let free = match part.card_free {
        Some(free) => free,
        None => {
            c.gpu()
                .mem_info()
                .map_err(|e| EngineError::Plan {
                    device: device.clone(),
                    why: format!("{}cannot read the free device memory: {e}", stage_prefix(part)),
                })?
                .0 as u64
        }
    };
    let ef = &flags.plan.experts;
    let config = PlanConfig::from_flags(&flags.plan, model.hp.n_ctx_train);
    let whole = part.whole;
    // Stages of a split on one card share its free memory, budget and reserve, in proportion to their layers.
    let mut plan = crate::memory::split::stage_plan(&model.gguf, &model.hp, &part.layers, part.share, free, &config)
        .map_err(|e| EngineError::Plan {
            device: device.clone(),
            why: format!("{}--kv {}: {e}", stage_prefix(part), flags.plan.kv),
        })?;
    let free = plan.free;
    let (weights, geometry) = crate::memory::split::stage_parts(&model.gguf, &model.hp, &part.layers);
    if !whole {
        eprintln!("strata: {}: memory plan of its layers:\n{}", part.label, plan.to_text());
    }
    if plan.cache_slots().is_some() && !ef.mmap_experts && pinned.is_none() {
        // The arena holds every expert of the model, whichever stage caches them.
        plan = plan.with_host_arena(WeightBytes::of(&model.gguf).experts, host_available_bytes());
    }
    let budget = plan
        .budget
        .map(|b| format!(", budget {:.2} GiB", b as f64 / GIB))
        .unwrap_or_default();
    let sizing = |what: String| {
        if ef.expert_cache == CacheSize::Auto {
            eprintln!(
                "strata: expert cache auto: {:.2} GiB free, {} MiB reserved{budget} -> {what}",
                free as f64 / GIB,
                plan.bytes(crate::memory::Part::Reserve) >> 20
            );
        }
    };
    match (plan.experts, geometry) {
        (Some(ExpertPlacement::AllResident), Some(g)) => sizing(format!("all {} experts resident", g.all())),
        (Some(ExpertPlacement::Cache { slots, .. }), Some(_)) => sizing(format!("{slots} slots")),
        _ => {}
    }
    if plan.verdict() == Verdict::DoesNotFit {
        return Err(fail(plan.shortfall(), &plan));
    }
    if let (
        Some(ExpertPlacement::Cache {
            slots,
            staging,
            slot_bytes,
        }),
        Some(g),
    ) = (plan.experts, geometry)
    {
        if ef.mmap_experts {
            eprintln!(
                "strata: experts read in place from the model file ({:.2} GiB, --mmap-experts)",
                weights.experts as f64 / GIB
            );
        } else if pinned.is_none() {
            let all = WeightBytes::of(&model.gguf).experts;
            *pinned = make_arena(c, model, all);
            if pinned.is_some() {
                cuda_memory(c, &part.device, "the expert arena", all, true);
            }
        }
        let bytes = c
            .configure_expert_cache(ExpertCacheConfig {
                n_layer: model.hp.n_layer as usize,
                n_expert: g.n_expert,
                slots,
                staging,
                slot_bytes: slot_bytes as usize,
                policy: ef.expert_policy,
                k: model.hp.n_expert_used as usize,
                arena: pinned.as_ref().and_then(HostPin::mapping),
                device_table: crate::switches::speed_on(crate::switches::DEVICE_SLOT_TABLE, &c.gpu().target),
                fetch_overlap: crate::switches::speed_on(crate::switches::FETCH_OVERLAP, &c.gpu().target),
                cpu_join: crate::switches::speed_on(crate::switches::CPU_JOIN, &c.gpu().target),
                n_embd: model.hp.n_embd as usize,
                upload_cap: ef.upload_cap.unwrap_or(u32::MAX),
                // The router's guess of a layer that a trace routes would name other experts.
                prefetch: ef.expert_prefetch && ef.routing_trace.is_none(),
            })
            .map_err(|e| fail(format!("the expert cache's {slots} + {staging} slots: {e}"), &plan))?;
        cuda_memory(c, &part.device, "the expert cache", bytes as u64, false);
        eprintln!(
            "strata: expert cache {slots} of {} slots ({:.1}%), {:.2} GiB of VRAM ({staging} staging slots, {} per slot, {} eviction{}, {})",
            g.all(),
            100.0 * slots as f64 / g.all().max(1) as f64,
            bytes as f64 / GIB,
            human_bytes(slot_bytes),
            ef.expert_policy,
            ef.upload_cap
                .map(|c| format!(", at most {c} admitted per layer and decode step"))
                .unwrap_or_default(),
            match (ef.expert_prefetch, ef.routing_trace.is_some()) {
                (false, _) => "no prefetch",
                (true, true) => "no prefetch: --routing-trace chooses the experts, not the router",
                (true, false) if ef.miss_policy == MissPolicy::Auto => {
                    "the next layer's experts prefetched at decode when auto's measurements find it faster"
                }
                (true, false) => "the next layer's experts prefetched at decode",
            }
        );
    }
    let dense = model.dense_weight_bytes(&part.layers);
    c.preload(&dense)
        .map_err(|e| fail(format!("the dense weights: {e}"), &plan))?;
    cuda_memory(
        c,
        &part.device,
        "the dense weights",
        dense.iter().map(|w| w.len() as u64).sum(),
        false,
    );
    if faults.probe_unsynced && !matches!(plan.experts, Some(ExpertPlacement::Cache { .. })) {
        eprintln!(
            "strata: {}=probe:unsynced does nothing here: every expert is resident, so no link probe runs (it runs for the expert cache)",
            crate::switches::FAULT
        );
    }
    if matches!(plan.experts, Some(ExpertPlacement::Cache { .. })) {
        let link = probe_link(c, model, &flags.device, faults.probe_unsynced);
        set_miss_plan(c, model, ef.miss_policy, pinned.is_some(), link).map_err(|e| {
            fail(
                format!("--miss-policy {}: the CPU's threads: {e}", ef.miss_policy),
                &plan,
            )
        })?;
    }
    // The KV pool's arrays now, at the plan's size: a failure names the plan here, not at the first request. Any
    // cache of the pool gives the layers' geometry; this one takes no block.
    let probe = crate::state::kv::KvCache::new_in(&model.hp.kv_shape(), config.context, config.kv, kv_pool)
        .map_err(|e| fail(format!("the KV cache: {e}"), &plan))?;
    let kv_bytes = c
        .alloc_kv_pool(&probe, part.layers.clone())
        .map_err(|e| fail(format!("the KV cache pool ({} tokens): {e}", plan.kv_cells), &plan))?;
    cuda_memory(c, &part.device, "the KV cache pool", kv_bytes, false);
    if let Ok((left, _)) = c.gpu().mem_info() {
        eprintln!(
            "strata: {} MiB of VRAM free with everything loaded, the KV cache pool included ({} MiB for {} tokens{})",
            left >> 20,
            kv_bytes >> 20,
            plan.kv_cells,
            match flags.plan.kv_tokens {
                Some(_) => " (--kv-tokens)".to_string(),
                None => format!(", {} sequences x {}", plan.sequences, plan.context),
            }
        );
    }
    Ok(())
}

/// `cuda:1 (layers 24-47): ` for a stage of a layer split, nothing for a whole model.
fn stage_prefix(part: &DevicePart) -> String {
    if part.whole {
        String::new()
    } else {
        format!("{}: ", part.label)
    }
}

/// The engine's KV block pool: `--kv-tokens` cells, or room for every sequence (`--parallel`) at its whole
/// context; its blocks on the device where the backend keeps its caches there (`on_device`: a GPU), else in host
/// memory.
///
/// `--kv-tokens` past what the sequences can hold at once is lowered to that, with a line saying so.
///
/// Errors: [`EngineError::Plan`] for `--kv-tokens` below one sequence's context (a sequence could never reach
/// it, and would be preempted for ever).
fn kv_pool(model: &crate::model::Model, flags: &EngineFlags, on_device: bool) -> Result<Arc<KvPool>, EngineError> {
    let cfg = crate::memory::PlanConfig::from_flags(&flags.plan, model.hp.n_ctx_train);
    let bad = |why: String| EngineError::Plan {
        device: flags.device.clone(),
        why,
    };
    // Every sequence at its whole context at once (each in whole blocks): the most the pool can be used for.
    let sequences = cfg.sequences.max(1);
    let full = crate::memory::full_pool_cells(cfg.context, sequences);
    match flags.plan.kv_tokens {
        Some(t) if t < cfg.context => {
            return Err(bad(format!(
                "--kv-tokens {t} is less than one sequence's context ({} tokens, --max-context): a sequence could never reach it; raise --kv-tokens or lower --max-context",
                cfg.context
            )));
        }
        Some(t) if t > full => eprintln!(
            "strata: --kv-tokens {t} is more than the sequences can hold at once (--parallel {sequences} x --max-context {}, each in whole blocks of {}): the pool holds {full}",
            cfg.context,
            crate::state::kv::KV_BLOCK_CELLS
        ),
        _ => {}
    }
    // The plan's KV cells: --kv-tokens in whole blocks, at most `full`.
    let cells = crate::memory::kv_cells(&cfg);
    Ok(KvPool::placed(&model.hp.kv_shape(), Some(cells), on_device))
}

/// On the CPU the KV caches live in host memory: the pool's blocks (`--kv-tokens`, by default `--parallel` of
/// `--max-context` cells) must fit in the memory available now, or the engine refuses to start, naming the numbers,
/// instead of being killed for memory once the caches fill (blocks are taken as they are written).
///
/// Errors: [`EngineError::Plan`] when they do not fit; nothing when the available memory cannot be read.
fn check_host_kv(model: &crate::model::Model, flags: &EngineFlags, pool: &KvPool) -> Result<(), EngineError> {
    let cfg = crate::memory::PlanConfig::from_flags(&flags.plan, model.hp.n_ctx_train);
    let cells = pool
        .capacity_blocks()
        .unwrap_or(0)
        .saturating_mul(crate::state::kv::KV_BLOCK_CELLS);
    let Ok(cell) = model.hp.kv_shape().cell_bytes(cfg.kv) else {
        return Ok(());
    };
    // In f64: a hostile --kv-tokens must not wrap or saturate the figure the error gives.
    let need = cell as f64 * cells as f64;
    let what = match flags.plan.kv_tokens {
        Some(_) => format!(
            "the KV cache of {cells} tokens (--kv-tokens, {} KV) needs",
            flags.plan.kv
        ),
        None => format!(
            "the KV caches of {} sequences of {} tokens ({} KV) need",
            cfg.sequences, cfg.context, flags.plan.kv
        ),
    };
    match crate::experts::store::host_available_bytes() {
        Some(avail) if need > avail as f64 => Err(EngineError::Plan {
            device: flags.device.clone(),
            why: format!(
                "{what} {:.2} GiB of host memory, and {:.2} GiB is available: lower {}",
                need / GIB,
                avail as f64 / GIB,
                if flags.plan.kv_tokens.is_some() {
                    "--kv-tokens"
                } else {
                    "--parallel or --max-context"
                }
            ),
        }),
        _ => Ok(()),
    }
}

/// Bytes in a GiB, for log lines in GiB.
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// The fault plan on a simulated device: the environment's rules and the profile's (`faults`, and the vendor
/// BLAS's GEMM row limit): the tighter GEMM row limit of the two, the environment's sticky rule else the
/// profile's; logs what the profile added.
///
/// Errors: the profile's `faults` do not parse (validated when it was read, so only a profile changed since).
fn sim_faults(
    mut faults: FaultPlan,
    hold: &crate::runtime::sim::SimHold,
    flags: &EngineFlags,
) -> Result<FaultPlan, EngineError> {
    let p = &hold.device.profile;
    let mut from_profile = match &p.faults {
        Some(f) => FaultPlan::parse(f)?,
        None => FaultPlan::default(),
    };
    let from_blas = from_profile.prefill_gemm_max_rows.is_none() && p.blas.gemm_fails_above_rows.is_some();
    if from_blas {
        from_profile.prefill_gemm_max_rows = p.blas.gemm_fails_above_rows.map(|n| n as usize);
    }
    if faults.sticky.is_none()
        && let Some(rule) = from_profile.sticky
    {
        eprintln!("strata: {}: the profile's faults add {rule}", flags.device);
        faults.sticky = Some(rule);
    }
    faults.probe_unsynced |= from_profile.probe_unsynced;
    // The device's limit holds whatever the environment adds: the tighter of the two fails first.
    if let Some(n) = from_profile.prefill_gemm_max_rows
        && faults.prefill_gemm_max_rows.is_none_or(|env| n < env)
    {
        faults.prefill_gemm_max_rows = Some(n);
        faults.prefill_gemm_error = if from_blas {
            p.blas.error.as_deref().map(std::sync::Arc::from)
        } else {
            None
        };
        eprintln!(
            "strata: {}: the {} prefill GEMM fails for batches of more than {n} rows ({})",
            flags.device,
            if from_blas { "vendor BLAS's" } else { "profile's" },
            if from_blas {
                p.blas.error.as_deref().unwrap_or("the profile says so")
            } else {
                "its faults"
            }
        );
    }
    Ok(faults)
}

/// The link a CUDA device is assumed to have when sysfs does not say (PCIe Gen5 x16, 63 GB/s): the H100/H200's.
const ASSUMED_LINK: crate::device::profile::LinkSpec = crate::device::profile::LinkSpec {
    pcie_gen: 5,
    pcie_width: 16,
    peak_gb_s: None,
    probe_gb_s: Vec::new(),
};

/// The link probe on a CUDA device (DESIGN.md section 1, seed 000): copies of one layer's gate experts from the
/// expert store (the 30B shape: 113 MB, past the H200's 50 MB L2; at most 256 MiB), checked against the link's
/// peak read from sysfs; one `probe` event. The rate to plan with, bytes per second (the peak-derived default
/// when the readings are impossible); `None` when there is nothing to copy or a copy failed (logged).
fn probe_link(c: &CudaBackend, model: &Model, device: &Device, unsynced: bool) -> Option<f64> {
    let ex = (0..model.hp.n_layer as usize).find_map(|il| model.layer_experts(il))?;
    let probe = &ex.gate.data[..ex.gate.data.len().min(256 << 20)];
    let readings = match c.measure_upload(probe, unsynced) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("strata: {device}: the link probe failed ({e})");
            return None;
        }
    };
    let peak = c
        .pci_bus_id()
        .and_then(|id| crate::device::probe::pcie_link(&id))
        .unwrap_or_else(|| {
            let mut p = crate::device::probe::LinkPeak::of(&ASSUMED_LINK);
            p.what += " (assumed: the link could not be read)";
            p
        });
    Some(crate::device::probe::judge(&device.to_string(), &readings, &peak).used_bytes_s)
}

/// Sets the miss plan of `--miss-policy` (DESIGN.md section 3, "Expert cache") and logs it in one line: `auto`
/// measures the link (a copy of one layer's gate experts from the expert store) and the CPU's expert rate and
/// per-step cost on the threads misses use ([`CudaBackend::cpu_expert_rate`]), and splits each decode
/// layer-step's misses by them ([`MissCost`]); `link` is the probe's rate ([`probe_link`]: the peak-derived
/// default when its readings were impossible), and without one (no probe ran, or it failed) misses are uploaded.
///
/// Errors: the CPU's worker threads could not be started.
fn set_miss_plan(
    c: &CudaBackend,
    model: &Model,
    policy: MissPolicy,
    pinned: bool,
    link: Option<f64>,
) -> std::io::Result<()> {
    let plan = |cost| MissPlan { policy, cost };
    match policy {
        MissPolicy::Upload => {
            eprintln!("strata: expert misses at decode are uploaded (--miss-policy upload)");
            return c.set_miss_plan(plan(None));
        }
        MissPolicy::Cpu => {
            eprintln!("strata: expert misses at decode are computed by the CPU (--miss-policy cpu)");
            return c.set_miss_plan(plan(None));
        }
        MissPolicy::Auto => {}
    }
    // Auto without rates uploads: the plan until (or unless) the probes below succeed.
    c.set_miss_plan(plan(None))?;
    let Some(ex) = (0..model.hp.n_layer as usize).find_map(|il| model.layer_experts(il)) else {
        return Ok(());
    };
    let Some(link) = link else {
        return Ok(());
    };
    let k = (model.hp.n_expert_used as usize).max(1);
    let Some(rate) = c.cpu_expert_rate(&ex, k) else {
        return Ok(());
    };
    let cost = MissCost {
        link_bytes_s: link,
        cpu_bytes_s: rate.bytes_s,
        cpu_fixed_s: rate.fixed_s,
        copies_s: COPIES_S,
    };
    let bytes = ex.expert_bytes();
    eprintln!(
        "strata: expert misses auto: link {:.1} GB/s ({}), CPU {:.1} GB/s + {:.0} us a step, + {:.0} us of copies on the host's path ({} threads): of {k} misses in a decode layer-step the CPU computes {} ({} on the device's table), of 1 {}",
        link / 1e9,
        if pinned {
            "page-locked arena"
        } else {
            "model file, pageable"
        },
        rate.bytes_s / 1e9,
        cost.cpu_fixed_s * 1e6,
        cost.copies_s * 1e6,
        c.cpu_expert_threads(),
        cost.cpu_count(k, bytes),
        c.joined_cpu_count(cost, k, bytes),
        cost.cpu_count(1, bytes),
    );
    c.set_miss_plan(plan(Some(cost)))
}

/// Seconds a layer-step's CPU side spends on copies outside the expert rows: the activations read back and the
/// rows' upload (each a few KB).
const COPIES_S: f64 = 20e-6;

/// The writer of `--dump-routing` at `path` for a model of hyper-parameters `hp`.
///
/// Errors: [`EngineError::DumpRouting`]: the model has no routed experts, `--routing-trace` replaces the
/// router's choices (the dump would be that trace), or the file cannot be opened or holds another trace.
fn routing_writer(
    path: &std::path::Path,
    hp: &crate::model::HParams,
    flags: &EngineFlags,
) -> Result<crate::experts::trace::TraceWriter, EngineError> {
    let bad = |why: String| EngineError::DumpRouting {
        path: path.to_path_buf(),
        why,
    };
    if !hp.is_moe() {
        return Err(bad("the model has no routed experts".into()));
    }
    if flags.plan.experts.routing_trace.is_some() {
        return Err(bad(
            "--routing-trace replaces the router's choices, so the dump would be that trace: give one of the two"
                .into(),
        ));
    }
    if let Some(why) = crate::experts::trace::geometry_error(hp.n_layer, hp.n_expert, hp.n_expert_used) {
        return Err(bad(why));
    }
    crate::experts::trace::TraceWriter::open(path, hp.n_layer, hp.n_expert, hp.n_expert_used)
        .map_err(|e| bad(e.to_string()))
}

/// Why a device without an expert cache cannot save a profile, and what to use instead.
const NO_CACHE_TO_LEARN: &str = "no expert cache counts lookups here; --dump-routing FILE records the routing \
     instead, and --expert-profile reads that file as a profile";

/// The profile `--expert-profile` names, checked against a model of hyper-parameters `hp`.
///
/// Errors: [`EngineError::ExpertProfile`]: the model has no routed experts, the file is not a profile or a
/// routing trace ([`ExpertProfile::read`]), or one of another geometry.
fn read_profile(path: &std::path::Path, hp: &crate::model::HParams) -> Result<ExpertProfile, EngineError> {
    let bad = |why: String| EngineError::ExpertProfile {
        flag: "--expert-profile",
        path: Some(path.to_path_buf()),
        why,
    };
    if !hp.is_moe() {
        return Err(bad("the model has no routed experts".into()));
    }
    let p = ExpertProfile::read(path).map_err(bad)?;
    match p.mismatch(hp.n_layer, hp.n_expert) {
        Some(why) => Err(bad(why)),
        None => Ok(p),
    }
}

/// What `--save-expert-profile` adds to: the profile at `path` when the file holds one of this model, none
/// (zeros) when it is missing or empty.
///
/// Errors: [`EngineError::ExpertProfile`]: the model has no routed experts, or the file holds a routing trace,
/// something that is not a profile, or a profile of another geometry (all of which saving would replace).
fn saved_profile(path: &std::path::Path, hp: &crate::model::HParams) -> Result<ExpertProfile, EngineError> {
    let bad = |why: String| EngineError::ExpertProfile {
        flag: "--save-expert-profile",
        path: Some(path.to_path_buf()),
        why,
    };
    if !hp.is_moe() {
        return Err(bad("the model has no routed experts".into()));
    }
    let empty = ExpertProfile::new(hp.n_layer, hp.n_expert);
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(empty),
        Err(e) => return Err(bad(format!("cannot read it: {e}"))),
    };
    // Nothing but white space (a file made with `touch`, say) holds nothing saving could lose.
    let blank = len <= 4096
        && std::fs::read(path)
            .map_err(|e| bad(format!("cannot read it: {e}")))?
            .iter()
            .all(u8::is_ascii_whitespace);
    if blank {
        return Ok(empty);
    }
    if crate::experts::trace::Trace::is_trace_file(path) {
        return Err(bad(
            "holds a routing trace, which saving a profile would replace: name another file".into(),
        ));
    }
    let p = ExpertProfile::read(path).map_err(|e| bad(format!("{e}; saving would replace it: name another file")))?;
    match p.mismatch(hp.n_layer, hp.n_expert) {
        Some(why) => Err(bad(format!("{why}; saving would replace it: name another file"))),
        None => Ok(p),
    }
}

/// Pre-fills `c`'s expert cache from `profile` (read from `path`), logging how many experts it placed and what
/// share of the profile's lookups they had.
///
/// Errors: [`EngineError::ExpertProfile`]: an upload failed.
fn prefill_from(
    c: &CudaBackend,
    model: &Model,
    path: &std::path::Path,
    profile: &ExpertProfile,
) -> Result<(), EngineError> {
    let ranked = profile.ranked();
    let start = Instant::now();
    let placed = c
        .prefill_expert_cache(model, &ranked)
        .map_err(|e| EngineError::ExpertProfile {
            flag: "--expert-profile",
            path: Some(path.to_path_buf()),
            why: format!("uploading its experts: {e}"),
        })?;
    let covered: u64 = ranked
        .iter()
        .take(placed)
        .map(|id| profile.lookups[(id.layer * profile.n_expert + id.expert) as usize])
        .sum();
    eprintln!(
        "strata: expert cache pre-filled from {} (--expert-profile): {placed} experts in {:.0} ms, {:.1}% of its {} lookups",
        path.display(),
        start.elapsed().as_secs_f64() * 1e3,
        100.0 * covered as f64 / profile.total().max(1) as f64,
        profile.total()
    );
    Ok(())
}

/// The replay of the routing trace at `path` into a model of hyper-parameters `hp`.
///
/// Errors: the trace cannot be read, or routes another geometry than the model's (naming the file).
fn replay_for(source: &RoutingSource, hp: &crate::model::HParams) -> Result<RoutingReplay, EngineError> {
    let bad = |why: String| EngineError::RoutingTrace {
        spec: source.clone(),
        why,
    };
    if !hp.is_moe() {
        return Err(bad("the model has no routed experts".into()));
    }
    let trace = source.trace(hp.n_layer, hp.n_expert, hp.n_expert_used).map_err(bad)?;
    RoutingReplay::new(&trace, hp.n_layer, hp.n_expert, hp.n_expert_used).map_err(bad)
}

/// The thread of [`Engine::memory_readings`]; dropping this stops it.
pub struct MemoryReadings {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for MemoryReadings {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// Emits a `memory` event for a CUDA device: `what` took `bytes` (device memory; with `host`, page-locked host
/// memory registered with it), and the driver's free and total memory after it (CUDA's stream-ordered pool
/// reserves in chunks of tens of MiB, so small parts may leave the free memory where it was). The device-memory plot of a
/// `cuda:` run draws these, as it draws a `sim:` device's (DESIGN.md section 3, "Device profiles").
fn cuda_memory(c: &CudaBackend, device: &Device, what: &str, bytes: u64, host: bool) {
    let Ok((free, total)) = c.gpu().mem_info() else {
        return;
    };
    crate::events::emit(crate::events::EventKind::Memory(crate::events::Memory {
        device: device.to_string(),
        op: if host { "register" } else { "alloc" }.into(),
        what: what.into(),
        bytes,
        host,
        free_bytes: free as u64,
        total_bytes: total as u64,
        scale: 1.0,
    }));
}

/// Copies the experts into a host arena and page-locks it, with a progress bar on a terminal and the rate in one
/// line. When the arena would not fit in host memory, cannot be allocated or cannot be locked, says so in one line
/// and leaves the experts read in place (`mmap`).
fn make_arena(c: &CudaBackend, model: &mut Model, bytes: u64) -> Option<HostPin> {
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(bytes);
        b.set_style(
            indicatif::ProgressStyle::with_template("copying the experts into the arena {bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let start = Instant::now();
    let made = model.use_arena(host_available_bytes(), |done, _| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Err(e) = made {
        eprintln!("strata: expert arena: {e}; reading the experts in place from the model file instead");
        return None;
    }
    let copied = start.elapsed().as_secs_f64();
    let t = Instant::now();
    let arena = model.experts.arena().expect("just made");
    match c.pin_host(arena) {
        Ok(pin) => {
            eprintln!(
                "strata: expert arena: {:.2} GiB copied in {:.1} s ({:.2} GiB/s), page-locked in {:.1} s",
                bytes as f64 / GIB,
                copied,
                bytes as f64 / GIB / copied.max(1e-9),
                t.elapsed().as_secs_f64()
            );
            Some(pin)
        }
        Err(e) => {
            model.experts.drop_arena();
            eprintln!(
                "strata: expert arena: cannot page-lock it ({e}); reading the experts in place from the model file instead"
            );
            None
        }
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
                "--batch-invariant",
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
    fn batch_invariant_refuses_the_routing_flags_on_a_gpu_alone() {
        let check = |args: &[&str]| {
            let a = Cli::parse_from([&["x", "--batch-invariant"], args].concat()).flags;
            a.check_batch_invariant().map_err(|e| e.to_string())
        };
        let dump = check(&["--device", "cuda:0", "--dump-routing", "r.jsonl"]).unwrap_err();
        assert!(
            dump.contains("--batch-invariant cannot be used with --dump-routing"),
            "{dump}"
        );
        let trace = check(&["--device", "cuda:0", "--routing-trace", "synth:locality"]).unwrap_err();
        assert!(trace.contains("with --routing-trace"), "{trace}");
        assert!(check(&["--device", "cuda:0"]).is_ok());
        // The CPU's kernels are invariant already: nothing to refuse.
        assert!(check(&["--dump-routing", "r.jsonl"]).is_ok());
        let off = Cli::parse_from(["x", "--device", "cuda:0", "--dump-routing", "r.jsonl"]).flags;
        assert!(off.check_batch_invariant().is_ok());
    }

    #[test]
    fn an_unknown_sim_profile_is_refused_by_name_before_the_model_is_read() {
        let flags = Cli::parse_from(["x", "--device", "sim:rx9999", "--model", "/nonexistent.gguf"]).flags;
        let e = Engine::open(&flags).err().unwrap().to_string();
        assert!(e.contains("--device sim:rx9999") && e.contains("rx9999.yaml"), "{e}");
        let flags = Cli::parse_from(["x", "--cache-sizing", "original", "--model", "/nonexistent.gguf"]).flags;
        let e = Engine::open(&flags).err().unwrap().to_string();
        assert!(
            e.contains("--cache-sizing original") && e.contains("sim:PROFILE"),
            "{e}"
        );
    }
}
