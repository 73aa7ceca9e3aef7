//! The engine on a simulated device (`--device sim:PROFILE`, DESIGN.md section 3, "Device profiles"): the CPU
//! computes, and the device's memory is a simulated account ([`SimDevice`]) that the engine plans against and
//! allocates from, part by part, in the order a GPU engine would, so that a report's memory failure happens here
//! too and is named.
//!
//! Two sizings (`--cache-sizing`):
//! - `plan` (ours): every part (dense weights, expert cache and staging slots, KV cache, prefill buffers, reserve)
//!   is planned against the free memory read before anything is registered. On a UMA device registering the host
//!   arena charges it against the device's memory, so the arena is a part of the plan; when the plan with it does
//!   not fit, the experts are read in place from the model file instead (one log line).
//! - `original` (the original Strata's, seed 001): the dense weights and the KV cache are allocated, the arena is
//!   registered, the free memory is read (collapsed on a UMA device) and the cache takes all of it but the reserve;
//!   the prompt path's and decode buffers are allocated after it, out of what is left.

use std::sync::Arc;

use crate::device::sim::{SimAlloc, SimAllocError, SimDevice};
use crate::memory::{
    CacheSize, CacheSizing, ExpertGeometry, ExpertPlacement, MemoryPlan, Part, PlanConfig, Verdict, WeightBytes,
    cache::size_cache, gib, human_bytes,
};
use crate::model::Model;
use crate::runtime::engine::{EngineError, EngineFlags, GIB};

/// What the engine holds on a simulated device: the device and its live allocations (freed when dropped).
#[derive(Debug)]
pub struct SimHold {
    pub device: Arc<SimDevice>,
    /// The allocations and the arena's registration, in the order they were made.
    pub allocs: Vec<SimAlloc>,
    /// The plan the engine sized from.
    pub plan: MemoryPlan,
    /// The reserve in the card's MiB (`--vram-reserve-mib`, or the driver's floor when that is more).
    reserve_mib: u64,
}

/// Opens `sim:name` for `model` and allocates what `flags` ask for on it, logging as a GPU engine does.
///
/// Errors: [`EngineError::Device`]-like [`EngineError::Plan`]: the profile cannot be read, the plan does not fit
/// (before anything is allocated), or an allocation failed (naming it, the driver's error, and what was allocated
/// and planned).
pub fn open(name: &str, model: &mut Model, flags: &EngineFlags) -> Result<SimHold, EngineError> {
    let device = flags.device.clone();
    if flags.plan.experts.cache_sizing == CacheSizing::Original && flags.plan.experts.vram_budget.is_some() {
        return Err(EngineError::Plan {
            device,
            why: "--vram-budget with --cache-sizing original: the original Strata had no budget (it sized the cache from the free memory it read); drop one of them".into(),
        });
    }
    let weights = WeightBytes::of(&model.gguf);
    let dev =
        SimDevice::open(name, (weights.experts > 0).then_some(weights.experts)).map_err(|e| EngineError::Plan {
            device: device.clone(),
            why: e.to_string(),
        })?;
    let p = &dev.profile;
    let (free0, total) = dev.mem_info();
    eprintln!(
        "strata: {device}: {} ({}, wave{}, {} compute units, {}), simulated: the CPU computes, the profile gives the memory, link and faults{}",
        p.name,
        p.arch,
        p.wave,
        p.multiprocessors,
        if p.memory.uma { "UMA" } else { "discrete" },
        if dev.scale() == 1.0 {
            String::new()
        } else {
            format!(
                "; every size x{:.3e} (the card's {:.2} GiB are {} here)",
                dev.scale(),
                p.memory.total.0 as f64 / GIB,
                human_bytes(total)
            )
        }
    );
    // The link probe at start, as the original's: the profile's readings, checked against the link's peak.
    let peak = crate::device::probe::LinkPeak::of(&p.link);
    let readings = if p.link.probe_gb_s.is_empty() {
        vec![peak.bytes_s / 1e9 * crate::device::probe::DEFAULT_LINK_FRACTION]
    } else {
        p.link.probe_gb_s.clone()
    };
    crate::device::probe::judge(&device.to_string(), &readings, &peak);
    let ef = &flags.plan.experts;
    let mut config = PlanConfig::from_flags(&flags.plan, model.hp.n_ctx_train);
    // The reserve in the card's MiB, as the log lines quote it (the driver's floor when that is more).
    let reserve_mib = ef.vram_reserve_mib.max(p.memory.driver_keeps_free.0 >> 20);
    let keeps = dev.driver_keeps_free();
    config.reserve = dev.scaled(config.reserve).max(keeps);
    config.budget = config.budget.map(|b| dev.scaled(b));
    if keeps > 0 && dev.scaled(ef.reserve_bytes()) < keeps {
        eprintln!(
            "strata: {device}: the driver keeps {} free ({} on the card): the reserve is raised to it",
            human_bytes(keeps),
            human_bytes(p.memory.driver_keeps_free.0)
        );
    }
    let geometry = ExpertGeometry::of(&model.gguf, &model.hp);
    let hp = model.hp.clone();
    let plan_at = |free: u64| {
        MemoryPlan::new(&weights, &hp, geometry.as_ref(), &config, free).map_err(|e| EngineError::Plan {
            device: device.clone(),
            why: format!("--kv {}: {e}", flags.plan.kv),
        })
    };
    let plan = plan_at(free0)?;
    let mut hold = SimHold {
        device: dev.clone(),
        allocs: Vec::new(),
        plan: plan.clone(),
        reserve_mib,
    };
    match ef.cache_sizing {
        CacheSizing::Plan => plan_sizing(&mut hold, model, flags, plan, &plan_at, &weights, geometry)?,
        CacheSizing::Original => original_sizing(&mut hold, model, flags, &config, &weights, geometry)?,
    }
    let (left, _) = dev.mem_info();
    eprintln!(
        "strata: {} of {device}'s memory free with everything loaded{}",
        human_bytes(left),
        if dev.scale() == 1.0 {
            String::new()
        } else {
            format!(" ({:.2} GiB on the card)", dev.unscaled(left) as f64 / GIB)
        }
    );
    Ok(hold)
}

/// Ours: plan first, then allocate exactly the plan.
fn plan_sizing(
    hold: &mut SimHold,
    model: &mut Model,
    flags: &EngineFlags,
    mut plan: MemoryPlan,
    plan_at: &dyn Fn(u64) -> Result<MemoryPlan, EngineError>,
    weights: &WeightBytes,
    geometry: Option<ExpertGeometry>,
) -> Result<(), EngineError> {
    let dev = hold.device.clone();
    let ef = &flags.plan.experts;
    let device = &flags.device;
    let (free0, _) = dev.mem_info();
    let mut arena = false;
    if plan.cache_slots().is_some() && !ef.mmap_experts {
        let available = dev.host_available();
        if weights.experts > available {
            eprintln!(
                "strata: expert arena: {} does not fit the host's {} available; reading the experts in place from the model file instead",
                human_bytes(weights.experts),
                human_bytes(available)
            );
        } else if dev.profile.memory.uma {
            let charged =
                plan_at(free0.saturating_sub(weights.experts))?.with_uma_arena(weights.experts, Some(available));
            if charged.verdict() == Verdict::Fits {
                plan = charged;
                arena = true;
            } else {
                eprintln!(
                    "strata: expert arena: {device} is a UMA device, where registering the arena's {} charges it against the device's {} free, and the plan would not fit ({}); reading the experts in place from the model file instead",
                    human_bytes(weights.experts),
                    human_bytes(free0),
                    charged.shortfall()
                );
            }
        } else {
            plan = plan.with_host_arena(weights.experts, Some(available));
            arena = true;
        }
    }
    hold.plan = plan.clone();
    if let (Some(g), Some(placement), CacheSize::Auto) = (geometry, plan.experts, ef.expert_cache) {
        log_sizing(hold, free0, &g, placement, "");
    }
    if plan.verdict() == Verdict::DoesNotFit {
        return Err(failed(device, plan.shortfall(), hold));
    }
    if arena {
        register_arena(hold, model, flags, weights.experts)?;
    } else if plan.cache_slots().is_some() {
        eprintln!(
            "strata: experts read in place from the model file ({})",
            human_bytes(weights.experts)
        );
    }
    for (part, bytes) in plan.parts.clone() {
        if matches!(part, Part::Reserve | Part::UmaArena) || bytes == 0 {
            continue;
        }
        let what = match (part, plan.experts) {
            (Part::ExpertCache, Some(ExpertPlacement::Cache { slots, .. })) => {
                format!("the expert cache ({slots} slots)")
            }
            _ => format!("the {}", part.label()),
        };
        alloc(hold, flags, &what, bytes)?;
    }
    log_cache(flags, plan.experts, geometry, arena);
    Ok(())
}

/// The original Strata's order and formula (seeds 000 and 001).
fn original_sizing(
    hold: &mut SimHold,
    model: &mut Model,
    flags: &EngineFlags,
    config: &PlanConfig,
    weights: &WeightBytes,
    geometry: Option<ExpertGeometry>,
) -> Result<(), EngineError> {
    let dev = hold.device.clone();
    let ef = &flags.plan.experts;
    let plan = hold.plan.clone();
    alloc(hold, flags, "the dense weights", weights.dense)?;
    alloc(hold, flags, "the KV cache", plan.bytes(Part::KvCache))?;
    let mut arena = false;
    let mut placed = None;
    if let Some(g) = geometry.filter(|_| weights.experts > 0) {
        if !ef.mmap_experts && weights.experts <= dev.host_available() {
            register_arena(hold, model, flags, weights.experts)?;
            arena = true;
        }
        // The original reads the free memory now, after the arena is registered: on a UMA device the reading has
        // collapsed by the arena's bytes.
        let (free, _) = dev.mem_info();
        let room = free.saturating_sub(config.reserve);
        // The original had no staging slots: every expert resident when they fit the room, else slots filling it.
        let placement = if config.cache == CacheSize::Auto && weights.experts <= room {
            ExpertPlacement::AllResident
        } else {
            // (One sequence's staging, given back to the room: the original's slots.)
            size_cache(
                config.cache,
                &g,
                false,
                room.saturating_add(g.staging(false, room) as u64 * g.slot_bytes),
                u64::MAX,
            )
        };
        if config.cache == CacheSize::Auto {
            let after = if arena {
                "were allocated and the arena registered"
            } else {
                "were allocated"
            };
            log_sizing(
                hold,
                free,
                &g,
                placement,
                &format!(" (--cache-sizing original: the free memory read after the weights and the KV cache {after})"),
            );
        }
        let (what, bytes) = match placement {
            ExpertPlacement::AllResident => ("the experts (all resident)".to_string(), weights.experts),
            ExpertPlacement::Cache { slots, slot_bytes, .. } => {
                (format!("the expert cache ({slots} slots)"), slots as u64 * slot_bytes)
            }
        };
        alloc(hold, flags, &what, bytes)?;
        placed = Some(placement);
    } else {
        alloc(hold, flags, "the experts (all resident)", weights.experts)?;
    }
    eprintln!("strata: session is up (--cache-sizing original)");
    alloc(
        hold,
        flags,
        "the prompt path's buffers",
        plan.bytes(Part::PrefillBuffers),
    )?;
    // The decode step's activations: the embedding row and the logits, f32 (seed 001's "embedding buffer" was
    // n_embd f32, 10 KB).
    let decode = (model.hp.n_embd as u64 + model.weights.output.rows as u64) * 4;
    alloc(hold, flags, "the decode buffers", decode)?;
    log_cache(flags, placed, geometry, arena);
    Ok(())
}

/// Copies the experts into a host arena and registers it with the device.
fn register_arena(hold: &mut SimHold, model: &mut Model, flags: &EngineFlags, bytes: u64) -> Result<(), EngineError> {
    let dev = hold.device.clone();
    let t = std::time::Instant::now();
    if let Err(e) = model.use_arena(Some(dev.host_available()), |_, _| {}) {
        eprintln!("strata: expert arena: {e}; reading the experts in place from the model file instead");
        return Ok(());
    }
    let pages = if dev.profile.host.large_pages {
        "large pages"
    } else {
        "large pages refused, 4 KB pages"
    };
    let r = dev
        .register_host("the expert arena", bytes)
        .map_err(|e| failed_alloc(&flags.device, e, hold))?;
    hold.allocs.push(r);
    eprintln!(
        "strata: expert arena: {} copied in {:.1} s, {} ok ({pages}){}",
        human_bytes(bytes),
        t.elapsed().as_secs_f64(),
        dev.profile.api.host_register(),
        if dev.profile.memory.uma {
            format!(
                "; a UMA device: the device now reads {} free",
                human_bytes(dev.mem_info().0)
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

fn alloc(hold: &mut SimHold, flags: &EngineFlags, what: &str, bytes: u64) -> Result<(), EngineError> {
    let a = hold
        .device
        .alloc(what, bytes)
        .map_err(|e| failed_alloc(&flags.device, e, hold))?;
    hold.allocs.push(a);
    Ok(())
}

/// The original's sizing line, "expert cache auto: X GiB free, Y MiB reserved -> N slots", in the card's units, with
/// `note` and the sizes at the simulation's scale.
fn log_sizing(hold: &SimHold, free: u64, g: &ExpertGeometry, placement: ExpertPlacement, note: &str) {
    let dev = &hold.device;
    eprintln!(
        "strata: expert cache auto: {:.2} GiB free, {} MiB reserved -> {}{note}{}",
        dev.unscaled(free) as f64 / GIB,
        hold.reserve_mib,
        match placement {
            ExpertPlacement::AllResident => format!("all {} experts resident", g.all()),
            ExpertPlacement::Cache { slots, .. } => format!("{slots} slots"),
        },
        if dev.scale() == 1.0 {
            String::new()
        } else {
            format!(
                " ({} free and {} reserved here)",
                human_bytes(free),
                human_bytes(dev.scaled(hold.reserve_mib << 20))
            )
        }
    );
}

fn log_cache(flags: &EngineFlags, placed: Option<ExpertPlacement>, geometry: Option<ExpertGeometry>, arena: bool) {
    let (Some(g), Some(ExpertPlacement::Cache { slots, .. })) = (geometry, placed) else {
        return;
    };
    eprintln!(
        "strata: expert cache {slots} of {} slots on {} (simulated: the CPU computes every expert from {})",
        g.all(),
        flags.device,
        if arena { "the arena" } else { "the model file" }
    );
}

/// A failed allocation as an engine error: the call, the driver's error, what was allocated, and the plan.
fn failed_alloc(device: &crate::device::Device, e: SimAllocError, hold: &SimHold) -> EngineError {
    failed(device, e.to_string(), hold)
}

fn failed(device: &crate::device::Device, why: String, hold: &SimHold) -> EngineError {
    let dev = &hold.device;
    let (free, total) = dev.mem_info();
    let mut s = format!("{why}\nallocated on the device so far:\n");
    for a in &hold.allocs {
        s += &format!("  {:<40} {}\n", a.what(), human_bytes(a.bytes()));
    }
    s += &format!("  {:<40} {} of {}\n", "free now", gib(free), gib(total));
    if dev.profile.memory.uma && dev.registered() > 0 {
        s += &format!(
            "  (a UMA device: the {} of registered host memory are charged against its free memory)\n",
            human_bytes(dev.registered())
        );
    }
    s += &format!("memory plan (--cache-sizing plan):\n{}", hold.plan.to_text());
    EngineError::Plan {
        device: device.clone(),
        why: s,
    }
}
