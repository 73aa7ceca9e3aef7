//! `strata device`: list CUDA devices, compile-check the kernels, and the device self-test with its memory plan
//! (seed 000 shows the shape of the output).

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use strata_engine::backend::cuda::buffer::{Arena, DevBuf};
use strata_engine::backend::cuda::{Gpu, compile, context};
use strata_engine::device::Device;
use strata_engine::device::cuda_libs as loader;
use strata_engine::experts::store::host_available_bytes;
use strata_engine::memory::{ExpertGeometry, MemoryPlan, PlanConfig, PlanFlags, WeightBytes, gib};
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
    /// The device of --selftest.
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    /// A model whose memory plan --selftest prints (`default` for the default model).
    #[arg(long)]
    model: Option<String>,
    /// KV cache, context and prefill chunk of the plan (the engine's flags).
    #[command(flatten)]
    plan: PlanFlags,
}

pub fn run(a: DeviceArgs) -> Result<()> {
    if a.check_kernels {
        return check_kernels();
    }
    if a.selftest {
        return selftest(&a);
    }
    list_devices()
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
    Ok(())
}

/// Arena of the allocation test.
const ARENA_BYTES: usize = 64 << 20;

fn selftest(a: &DeviceArgs) -> Result<()> {
    let Device::Cuda(ord) = a.device.clone() else {
        bail!(
            "--selftest tests a CUDA device; --device {} has nothing to test",
            a.device
        );
    };
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

    if let Some(m) = &a.model {
        plan(m, a, free)?;
    }
    println!(
        "\nselftest: arena {}, used {} after two 1 MiB allocations",
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
    println!("strata device selftest OK");
    Ok(())
}

/// The memory plan of `model` under the plan flags, against `free` bytes.
fn plan(model: &str, a: &DeviceArgs, free: usize) -> Result<()> {
    let path = models::resolve(Some(model))?;
    let gguf = GgufModel::open(&path)?;
    let hp = HParams::from_metadata(gguf.metadata())?;
    let config = PlanConfig::from_flags(&a.plan, hp.n_ctx_train);
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
