//! `strata device`: list CUDA devices, compile-check the kernels, and the device self-test with its memory plan
//! (seed 000 shows the shape of the output).

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use strata_engine::backend::cuda::buffer::{Arena, DevBuf};
use strata_engine::backend::cuda::{Gpu, compile, context};
use strata_engine::device::Device;
use strata_engine::device::cuda_libs as loader;
use strata_engine::device::sim::SimDevice;
use strata_engine::experts::store::host_available_bytes;
use strata_engine::memory::split::{self as layer_split, LayerSplit};
use strata_engine::memory::{ExpertGeometry, MemoryPlan, PlanConfig, PlanFlags, Verdict, WeightBytes, gib};
use strata_engine::{gguf::GgufModel, model::HParams, models};

#[derive(Args)]
pub struct DeviceArgs {
    /// Name, compute capability, SMs, memory, driver and runtime of every CUDA device, and whether our kernels
    /// compile for it.
    #[arg(long)]
    list_devices: bool,
    /// Arena allocation test, over-allocation refused, and the memory plan against free memory.
    #[arg(long)]
    selftest: bool,
    /// Compile every kernel with NVRTC for sm_90 and sm_80 (needs NVRTC only, no GPU or driver).
    #[arg(long)]
    check_kernels: bool,
    /// The device of --selftest (a layer split such as `cuda:0,cuda:1` tests each card and prints each stage's
    /// plan); with --list-devices, a `sim:PROFILE` lists the reported machine's devices.
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    /// With --selftest on a layer split and --model: the layers of each stage, as the engine takes it (`auto`:
    /// by what each card may hold).
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<LayerSplit>())]
    layer_split: LayerSplit,
    /// A model whose memory plan --selftest prints (`default` for the default model).
    #[arg(long)]
    model: Option<String>,
    /// KV cache, context and prefill chunk of the plan (the engine's flags).
    #[command(flatten)]
    plan: PlanFlags,
}

pub fn run(a: DeviceArgs) -> Result<()> {
    if a.layer_split != LayerSplit::Auto {
        if !a.selftest {
            bail!(
                "--layer-split {} goes with --selftest on a layer split (--device cuda:0,cuda:1)",
                a.layer_split
            );
        }
        if a.model.is_none() {
            bail!(
                "--layer-split {} places a model's layers: it goes with --model",
                a.layer_split
            );
        }
        if !matches!(a.device, Device::Split(_)) {
            bail!(
                "--layer-split {} places the layers of a split over several devices; --device {} is one",
                a.layer_split,
                a.device
            );
        }
    }
    if a.check_kernels {
        return check_kernels();
    }
    if let Device::Sim(name) = &a.device {
        return if a.selftest {
            sim_selftest(name, &a)
        } else {
            sim_list_devices(name)
        };
    }
    if a.selftest {
        return selftest(&a);
    }
    list_devices()
}

/// `--list-devices --device sim:NAME`: the devices the reported machine's driver listed, as the original's
/// `strata-device --list-devices` printed them (seed 000): the profile's card at its index among the others, each
/// with its arch and whether the reported build was compiled for it.
fn sim_list_devices(name: &str) -> Result<()> {
    let dev = SimDevice::open(name, None)?;
    let p = &dev.profile;
    println!(
        "sim:{name}: the devices of the reported machine ({}; simulated: the CPU computes)",
        api_name(p)
    );
    let mut others = p.other_devices.iter();
    let total = p.other_devices.len() + 1;
    for i in 0..total {
        if i == p.index {
            println!("device {i}: {}", p.name);
            println!(
                "  arch {}, {} ({} free), wave{}, {} compute units{}",
                p.arch,
                gib(p.memory.total.0),
                gib(p.memory.free.0),
                p.wave,
                p.multiprocessors,
                if p.memory.uma { ", UMA" } else { "" }
            );
            println!("  link {}, peak {:.1} GB/s", p.link.what(), p.link.peak_bytes_s() / 1e9);
            if p.compiled_for.contains(&p.arch) {
                println!("  runs as --device sim:{name}");
            } else {
                println!(
                    "  cannot run: {} is not an architecture this build was compiled for ({})",
                    p.arch,
                    p.compiled_for.join(", ")
                );
            }
        } else if let Some(o) = others.next() {
            println!("device {i}: {}", o.name);
            println!("  arch {}, {}, wave{}", o.arch, gib(o.memory.0), o.wave);
            if !p.compiled_for.contains(&o.arch) {
                println!(
                    "  cannot run: {} is not an architecture this build was compiled for ({})",
                    o.arch,
                    p.compiled_for.join(", ")
                );
            }
        }
    }
    Ok(())
}

/// The profile's API as its vendor writes it.
fn api_name(p: &strata_engine::device::profile::DeviceProfile) -> &'static str {
    match p.api {
        strata_engine::device::profile::Api::Hip => "HIP",
        strata_engine::device::profile::Api::Cuda => "CUDA",
    }
}

/// `--selftest --device sim:NAME`: the original's self-test on the simulated memory account (DESIGN.md section
/// 1, seed 000): the card, an allocation test, an over-allocation that the driver must refuse with its error, and
/// the memory plan of `--model` against the free memory.
fn sim_selftest(name: &str, a: &DeviceArgs) -> Result<()> {
    let experts = match &a.model {
        Some(m) => {
            let gguf = GgufModel::open(&models::resolve(Some(m))?)?;
            Some(WeightBytes::of(&gguf).experts).filter(|&b| b > 0)
        }
        None => None,
    };
    let dev = SimDevice::open(name, experts)?;
    // A card of an arch the reported build was not compiled for fails here as the engine would.
    a.device.available()?;
    let p = &dev.profile;
    let (free, total) = dev.mem_info();
    if total < 1 << 20 {
        bail!(
            "sim:{name}: the profile's scale (x{:.3e}) leaves the card {total} B: too small to test (a simulated card needs at least 1 MiB)",
            dev.scale()
        );
    }
    println!("device {}: {} (sim:{name}, simulated)", p.index, p.name);
    println!(
        "  {} arch            {} wave{} (compiled for {})",
        api_name(p),
        p.arch,
        p.wave,
        p.compiled_for.join(",")
    );
    println!("  multiprocessors     {}", p.multiprocessors);
    println!("  VRAM total / free   {} / {}", gib(total), gib(free));
    if dev.scale() != 1.0 {
        println!(
            "  scale               x{:.3e} (sizes above are the simulation's)",
            dev.scale()
        );
    }
    let arena_bytes = (ARENA_BYTES as u64).min(free / 2);
    let arena = dev.alloc("the selftest arena", arena_bytes)?;
    let two = dev
        .alloc("a 1 MiB allocation", 1 << 20)
        .and_then(|x| Ok((x, dev.alloc("a 1 MiB allocation", 1 << 20)?)));
    let over = total + (1u64 << 30);
    let refused = dev.alloc("an over-allocation", over);
    let usable = dev.alloc("a 1 MiB allocation after it", 1 << 20).is_ok();
    if let Some(m) = &a.model {
        plan(
            m,
            a,
            dev.mem_info().0 as usize + arena_bytes as usize + (2 << 20),
            Some(&dev),
        )?;
    }
    let two_ok = two.is_ok();
    drop((two, arena));
    println!(
        "\nselftest: arena {}, two 1 MiB allocations: {}",
        gib(arena_bytes),
        if two_ok { "ok" } else { "failed" }
    );
    match refused {
        Err(e) if usable && two_ok => {
            println!(
                "selftest: over-allocation of {} refused as required ({})",
                gib(over),
                e.error
            );
            println!("strata device selftest OK");
            Ok(())
        }
        _ => bail!(
            "selftest: over-allocation of {} was not refused as required, or the device was unusable after it",
            gib(over)
        ),
    }
}

fn check_kernels() -> Result<()> {
    let found = loader::load_nvrtc()?;
    println!("NVRTC {} ({:?})", found.from, compile::nvrtc_version());
    for arch in ["sm_90", "sm_80"] {
        let t = Instant::now();
        compile::compile_ptx(arch)?;
        println!(
            "kernels compile for {arch}: yes ({:.0} ms)",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(())
}

fn list_devices() -> Result<()> {
    let n = match context::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("no CUDA devices: {e}");
            return Ok(());
        }
    };
    let libs = loader::load()?;
    let drv = compile::driver_version()?;
    let rt = compile::nvrtc_version().map_or("unknown".into(), |(a, b)| format!("{a}.{b}"));
    println!(
        "driver {}.{} ({}), NVRTC {rt} ({})",
        drv / 1000,
        drv % 1000 / 10,
        libs.driver.from,
        libs.nvrtc.from
    );
    println!(
        "cuBLAS {}",
        libs.cublas
            .as_ref()
            .map_or("not found (the prefill GEMM uses our own kernel)".into(), |f| f
                .from
                .clone())
    );
    for i in 0..n {
        let ctx = cudarc::driver::CudaContext::new(i)?;
        let (maj, min) = ctx.compute_capability()?;
        let sms = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let (free, total) = ctx.mem_get_info()?;
        println!("device {i}: {}", ctx.name()?);
        println!("  compute capability  {maj}.{min} ({})", compile::arch_name(maj, min));
        println!("  multiprocessors     {sms}");
        println!("  VRAM total / free   {} / {}", gib(total as u64), gib(free as u64));
        println!("  driver / runtime    {drv} / {rt}");
        drop(ctx);
        match Gpu::open(i) {
            Ok(g) => println!(
                "  our kernels         compile for {}: yes ({}, {:.0} ms)",
                g.compile.arch,
                if g.compile.cached {
                    "from the cache"
                } else {
                    "compiled now"
                },
                g.compile.ms
            ),
            Err(e) => println!("  our kernels         cannot run: {e}"),
        }
    }
    print_links(n)
}

/// The links between the devices, as a layer split (`--device cuda:0,cuda:1`) would use them: peer access each
/// way (`cuDeviceCanAccessPeer`) for every pair; without it the split's copies are staged through host memory by
/// the driver. The split logs what one crossing measured at start.
fn print_links(n: usize) -> Result<()> {
    if n < 2 {
        println!("links: one device (a layer split over cuda:0,cuda:0 copies on the card)");
        return Ok(());
    }
    let devs = (0..n)
        .map(|i| Ok(cudarc::driver::CudaContext::new(i)?.cu_device()))
        .collect::<Result<Vec<_>>>()?;
    println!("links (peer access, as a layer split copies between the cards):");
    for a in 0..n {
        for b in (a + 1)..n {
            let mut can = [0i32; 2];
            for (k, (x, y)) in [(a, b), (b, a)].into_iter().enumerate() {
                // SAFETY: `can[k]` is a live int the call writes; both devices exist (ordinals below the count).
                unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can[k], devs[x], devs[y]) }.result()?;
            }
            let how = match can {
                [1, 1] => "peer access both ways: direct copies",
                [0, 0] => "no peer access: copies staged through host memory",
                _ => "peer access one way only: copies staged through host memory",
            };
            println!("  cuda:{a} <-> cuda:{b}: {how}");
        }
    }
    Ok(())
}

/// Arena of the allocation test.
const ARENA_BYTES: usize = 64 << 20;

/// `--selftest` on a CUDA device, or on each card of a layer split; then the memory plan of `--model` (each
/// stage's, placed as the engine places them, for a split).
fn selftest(a: &DeviceArgs) -> Result<()> {
    let ords = match &a.device {
        Device::Cuda(ord) => vec![*ord],
        Device::Split(ords) => ords.clone(),
        _ => bail!(
            "--selftest tests a CUDA device; --device {} has nothing to test",
            a.device
        ),
    };
    // Each card once, in the order the split names them; its free memory read before its test.
    let mut free_of = std::collections::BTreeMap::new();
    for &ord in &ords {
        if let std::collections::btree_map::Entry::Vacant(e) = free_of.entry(ord) {
            if ords.len() > 1 {
                println!();
            }
            e.insert(card_selftest(ord)?);
        }
    }
    if let Some(m) = &a.model {
        if ords.len() == 1 {
            plan(m, a, free_of[&ords[0]], None)?;
        } else {
            split_plans(m, a, &ords, &free_of)?;
        }
    }
    if ords.len() > 1 {
        println!("\nstrata device selftest OK ({} cards: {})", free_of.len(), a.device);
    } else {
        println!("strata device selftest OK");
    }
    Ok(())
}

/// Each stage's memory plan of `model` on a layer split over `ords`, placed as the engine places it
/// ([`layer_split::place`]) from the cards' free memory `free_of` (bytes, by ordinal); the host arena is counted
/// once, on the first stage with an expert cache.
fn split_plans(
    model: &str,
    a: &DeviceArgs,
    ords: &[usize],
    free_of: &std::collections::BTreeMap<usize, usize>,
) -> Result<()> {
    let path = models::resolve(Some(model))?;
    let gguf = GgufModel::open(&path)?;
    let hp = HParams::from_metadata(gguf.metadata())?;
    let config = PlanConfig::from_flags(&a.plan, hp.n_ctx_train);
    let card_free: Vec<u64> = ords.iter().map(|o| free_of[o] as u64).collect();
    let stages = layer_split::place(&gguf, &hp, ords, &card_free, &config, &a.layer_split)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    println!(
        "\nlayer split over {} ({}): {}",
        a.device,
        a.layer_split.how(),
        stages
            .iter()
            .map(|s| format!("cuda:{} {} layers", s.ord, s.layers.len()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut arena = false;
    let mut unfit = Vec::new();
    for (s, free) in stages.iter().zip(card_free) {
        let mut plan = layer_split::stage_plan(&gguf, &hp, &s.layers, s.share, free, &config)
            .map_err(|e| anyhow::anyhow!("{}: --kv {}: {e}", path.display(), a.plan.kv))?;
        if plan.cache_slots().is_some() && !a.plan.experts.mmap_experts && !arena {
            plan = plan.with_host_arena(WeightBytes::of(&gguf).experts, host_available_bytes());
            arena = true;
        }
        let label = layer_split::stage_label(&Device::Cuda(s.ord), &s.layers);
        println!(
            "\nmemory plan  {label}  {}  --max-context {} --kv {} --prefill {} --expert-cache {}{}",
            path.display(),
            plan.context,
            plan.kv,
            config.prefill_chunk,
            config.cache,
            if s.share.0 < s.share.1 {
                format!(
                    " (a {}/{} share of the card: its layers of the layers it holds)",
                    s.share.0, s.share.1
                )
            } else {
                String::new()
            }
        );
        print!("{}", plan.to_text());
        if plan.verdict() == Verdict::DoesNotFit {
            unfit.push(label);
        }
    }
    if !unfit.is_empty() {
        println!("\nthe plan does not fit on {}", unfit.join(", "));
    }
    Ok(())
}

/// The self-test of one CUDA card: what it is, an arena allocation, an over-allocation the driver must refuse
/// and the card still usable after it. Returns its free memory in bytes, read before the test allocated.
///
/// Errors: the card does not open, or the over-allocation was not refused.
fn card_selftest(ord: usize) -> Result<usize> {
    let t0 = Instant::now();
    let gpu = Gpu::open(ord)?;
    let start_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (free, total) = gpu.mem_info()?;
    let (maj, min) = gpu.ctx.compute_capability()?;
    let sms = gpu
        .ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    println!("device {ord}: {}", gpu.ctx.name()?);
    println!("  CUDA arch           sm_{maj}{min} (kernels for {})", gpu.compile.arch);
    println!("  multiprocessors     {sms}");
    println!("  VRAM total / free   {} / {}", gib(total as u64), gib(free as u64));
    println!(
        "  driver / runtime    {} / {:?}",
        compile::driver_version()?,
        compile::nvrtc_version().unwrap_or((0, 0))
    );
    println!(
        "  start               {start_ms:.0} ms (kernels {}, {:.0} ms)",
        if gpu.compile.cached {
            "from the cache"
        } else {
            "compiled"
        },
        gpu.compile.ms
    );

    // Arena: one allocation, carved by a bump pointer; asking for more than is left must be refused.
    let mut arena = Arena::new(&gpu.stream, ARENA_BYTES)?;
    let two = arena.alloc(1 << 20).is_some() && arena.alloc(1 << 20).is_some();
    let used = arena.used();
    let refused_in_arena = two && arena.alloc(arena.capacity()).is_none();
    let over = total + (1usize << 30);
    let refused_by_driver = DevBuf::alloc(&gpu.stream, over).is_err();
    // The failed allocation must leave the context usable.
    let after = DevBuf::alloc(&gpu.stream, 1 << 20).is_ok();
    drop(arena);

    println!(
        "selftest: arena {}, used {} after two 1 MiB allocations",
        gib(ARENA_BYTES as u64),
        gib(used as u64)
    );
    if !(refused_in_arena && refused_by_driver && after) {
        bail!(
            "selftest: over-allocation of {} was not refused as required (arena {refused_in_arena}, driver {refused_by_driver}, usable after {after})",
            gib(over as u64)
        );
    }
    println!(
        "selftest: over-allocation refused as required ({} asked of the driver)",
        gib(over as u64)
    );
    Ok(free)
}

/// The memory plan of `model` under the plan flags, against `free` bytes; on a simulated device `sim`, the reserve
/// and budget scaled and the reserve raised to the driver's floor, as the engine plans there.
fn plan(model: &str, a: &DeviceArgs, free: usize, sim: Option<&SimDevice>) -> Result<()> {
    let path = models::resolve(Some(model))?;
    let gguf = GgufModel::open(&path)?;
    let hp = HParams::from_metadata(gguf.metadata())?;
    let mut config = PlanConfig::from_flags(&a.plan, hp.n_ctx_train);
    if let Some(d) = sim {
        config.reserve = d.scaled(config.reserve).max(d.driver_keeps_free());
        config.budget = config.budget.map(|b| d.scaled(b));
    }
    let geometry = ExpertGeometry::of(&gguf, &hp);
    let weights = WeightBytes::of(&gguf);
    let mut plan = MemoryPlan::new(&weights, &hp, geometry.as_ref(), &config, free as u64)
        .map_err(|e| anyhow::anyhow!("{}: --kv {}: {e}", path.display(), a.plan.kv))?;
    if plan.cache_slots().is_some() && !a.plan.experts.mmap_experts {
        plan = plan.with_host_arena(weights.experts, host_available_bytes());
    }
    println!(
        "\nmemory plan  {}  --max-context {} --kv {} --prefill {} --expert-cache {}",
        path.display(),
        plan.context,
        plan.kv,
        config.prefill_chunk,
        config.cache
    );
    print!("{}", plan.to_text());
    Ok(())
}
