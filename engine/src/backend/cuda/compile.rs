//! The kernels of `kernels/`: their sources, NVRTC compilation for the device's arch, and the disk cache of the
//! result.
//!
//! Kernel cache: the PTX of the whole program is written to `<cache>/strata/kernels/strata-HASH-sm_XY-drvN.ptx`,
//! where HASH is FNV-1a 64 of the sources and options, XY the compute capability and N the driver version, so a
//! second start compiles nothing. `STRATA_KERNEL_CACHE` overrides the folder.

use std::path::PathBuf;

use super::error::CudaError;
use crate::switches;

/// The kernel sources, in compile order: the headers, then every `.cu` file of `kernels/`.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    ("quant.cuh", include_str!("../../../../kernels/quant.cuh")),
    ("matvec.cu", include_str!("../../../../kernels/matvec.cu")),
    ("elementwise.cu", include_str!("../../../../kernels/elementwise.cu")),
    ("attention.cu", include_str!("../../../../kernels/attention.cu")),
    ("gemm.cu", include_str!("../../../../kernels/gemm.cu")),
    ("sampling.cu", include_str!("../../../../kernels/sampling.cu")),
    ("experts.cu", include_str!("../../../../kernels/experts.cu")),
];

/// Every kernel the backend launches (each must exist in the compiled module).
pub const KERNEL_NAMES: &[&str] = &[
    "strata_trap",
    "top_logits_part",
    "top_logits_final",
    "mmv_f32",
    "mmv_f16",
    "mmv_bf16",
    "mmv_q4_0",
    "mmv_q4_1",
    "mmv_q5_0",
    "mmv_q5_1",
    "mmv_q8_0",
    "mmv_q2_k",
    "mmv_q3_k",
    "mmv_q4_k",
    "mmv_q5_k",
    "mmv_q6_k",
    "mmv_moe_f32",
    "mmv_moe_f16",
    "mmv_moe_bf16",
    "mmv_moe_q4_0",
    "mmv_moe_q4_1",
    "mmv_moe_q5_0",
    "mmv_moe_q5_1",
    "mmv_moe_q8_0",
    "mmv_moe_q2_k",
    "mmv_moe_q3_k",
    "mmv_moe_q4_k",
    "mmv_moe_q5_k",
    "mmv_moe_q6_k",
    "mmv_moe_group_q4_k",
    "mmv_moe_group_q6_k",
    "moe_groups",
    "get_rows_f32",
    "get_rows_f16",
    "get_rows_bf16",
    "get_rows_q4_0",
    "get_rows_q4_1",
    "get_rows_q5_0",
    "get_rows_q5_1",
    "get_rows_q8_0",
    "get_rows_q2_k",
    "get_rows_q3_k",
    "get_rows_q4_k",
    "get_rows_q5_k",
    "get_rows_q6_k",
    "dq_f16_f32",
    "dq_f16_f16",
    "dq_f16_bf16",
    "dq_f16_q4_0",
    "dq_f16_q4_1",
    "dq_f16_q5_0",
    "dq_f16_q5_1",
    "dq_f16_q8_0",
    "dq_f16_q2_k",
    "dq_f16_q3_k",
    "dq_f16_q4_k",
    "dq_f16_q5_k",
    "dq_f16_q6_k",
    "gemm_f32",
    "gemm_f16",
    "gemm_bf16",
    "gemm_q4_0",
    "gemm_q4_1",
    "gemm_q5_0",
    "gemm_q5_1",
    "gemm_q8_0",
    "gemm_q2_k",
    "gemm_q3_k",
    "gemm_q4_k",
    "gemm_q5_k",
    "gemm_q6_k",
    "f32_to_f16",
    "rms_norm",
    "rope",
    "scale_f32",
    "add_f32",
    "glu",
    "kv_store_f16",
    "kv_store2_f16",
    "kv_store_q8_0",
    "copy_f32",
    "copy_f32x4",
    "scatter_rows_f32",
    "expert_lookup",
    "expert_prefetch",
    "expert_fetch",
    "cpu_join",
    "mmv_wide_f32",
    "router_route",
    "mmv1_q4_k",
    "mmv1_q6_k",
    "mmvt_q4_k",
    "mmvt1_q4_k",
    "mmq_q4_k",
    "mmq_q6_k",
    "mmq_moe_q4_k",
    "mmq_moe_q6_k",
    "mmvt1_q6_k",
    "q8k_stage",
    "mmvt_q6_k",
    "add_rms_norm",
    "moe_combine_add_rms_norm",
    "qk_norm_rope",
    "moe_route",
    "moe_combine",
    "attn_decode",
    "attn_split_scores",
    "attn_split_exp",
    "attn_split_pv",
    "attn_prefill_f16",
    "attn_scores",
    "attn_softmax",
    "attn_pv",
    "sum_splits",
];

/// How the kernels were obtained at start.
#[derive(Debug, Clone)]
pub struct CompileReport {
    /// `sm_90`.
    pub arch: String,
    /// Read from the disk cache (no NVRTC call).
    pub cached: bool,
    /// NVRTC (or the cache read) plus the module load, in ms.
    pub ms: f64,
    pub path: PathBuf,
}

/// The folder of the kernel cache ([`crate::paths::kernel_cache_dir`]).
pub fn kernel_cache_dir() -> PathBuf {
    crate::paths::kernel_cache_dir()
}

/// The whole program NVRTC compiles: every source of [`KERNEL_SOURCES`] in order.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, text) in KERNEL_SOURCES {
        s.push_str(&format!("// ---- kernels/{name}\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// NVRTC's options: C++17, device functions by default, and the words of `STRATA_KERNEL_DEFINES` (a tuning
/// diagnostic: `-DMMV_MINB=3` compiles a variant of the kernels; part of the cache key like the rest).
fn nvrtc_options() -> Vec<String> {
    let mut o: Vec<String> = vec!["--std=c++17".into(), "-default-device".into()];
    if let Some(extra) = switches::text_lossy(switches::KERNEL_DEFINES) {
        o.extend(extra.split_whitespace().map(str::to_string));
    }
    o
}

/// Whether `ty` has kernels that read a weight row once for several tokens' Q8_K activations (`mmvt_*`,
/// `mmv_moe_group_*`): Q4_K, and Q6_K unless the kernels are the measurement build with f32 activations for Q6_K
/// (`-DMMV_Q6K_F32` in `STRATA_KERNEL_DEFINES`), whose Q6_K ones are stubs that trap.
pub(super) fn q8k_several_tokens(ty: crate::quant::GgmlType) -> bool {
    use crate::quant::GgmlType;
    static Q6K_F32: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        nvrtc_options()
            .iter()
            .any(|o| o.trim_start_matches("-D").starts_with("MMV_Q6K_F32"))
    });
    ty == GgmlType::Q4_K || (ty == GgmlType::Q6_K && !*Q6K_F32)
}

/// FNV-1a 64 of the program and options: the cache key's content part.
fn content_hash(src: &str, opts: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in src.bytes().chain(opts.iter().flat_map(|o| o.bytes())) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Compiles the program for `arch` (`sm_90`) with NVRTC; needs no driver.
///
/// Errors: NVRTC missing, or a compile error (the log names the file and line).
pub fn compile_ptx(arch: &'static str) -> Result<String, CudaError> {
    let src = program_source();
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: nvrtc_options(),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: format!("{e:?}"),
    })?;
    Ok(ptx.to_src())
}

/// NVRTC arch names are `&'static str`; these are the ones we compile for.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (m, _) if m >= 12 => "sm_120",
        (m, _) if m >= 10 => "sm_100",
        _ => "sm_80",
    }
}

/// The driver's version (`13000` for 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    let mut v = 0;
    // SAFETY: the driver library was loaded by `cuda_libs::load`; the call writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(CudaError::driver("cuDriverGetVersion"))?;
    Ok(v)
}

/// NVRTC's version as (major, minor): the CUDA runtime the kernels are compiled with.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC was loaded by `loader`; the call writes two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((a, b))
}

/// The PTX of the whole program for compute capability `major.minor` (NVRTC arch `arch`): read from the kernel
/// cache, or compiled and written there (module docs). Returns the PTX, whether it was read from the cache, and
/// its path.
///
/// Errors: the driver's version cannot be read, or the program does not compile.
pub(super) fn cached_ptx(arch: &'static str, major: i32, minor: i32) -> Result<(String, bool, PathBuf), CudaError> {
    let src = program_source();
    let key = content_hash(&src, &nvrtc_options());
    let drv = driver_version()?;
    let dir = kernel_cache_dir();
    let path = dir.join(format!("strata-{key:016x}-sm_{major}{minor}-drv{drv}.ptx"));
    let (ptx, cached) = match std::fs::read_to_string(&path) {
        Ok(p) => (p, true),
        Err(_) => {
            let p = compile_ptx(arch)?;
            // A cache that cannot be written only costs the next start a compile.
            let _ = std::fs::create_dir_all(&dir);
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &p).is_ok() {
                let _ = std::fs::rename(&tmp, &path);
            }
            (p, false)
        }
    };
    Ok((ptx, cached, path))
}

#[cfg(test)]
mod tests {
    use super::{KERNEL_NAMES, KERNEL_SOURCES};

    /// Every kernel a source file defines by name (not through a per-type macro) is in the launch list, so a
    /// new kernel cannot reach a GPU run unregistered ("no such kernel in the module").
    #[test]
    fn every_named_kernel_is_registered() {
        let mut defined = 0;
        for (file, src) in KERNEL_SOURCES {
            for part in src.split("extern \"C\" __global__ void").skip(1) {
                let part = part.trim_start();
                let part = match part.strip_prefix("__launch_bounds__(") {
                    Some(rest) => rest.split_once(')').map_or(rest, |(_, r)| r).trim_start(),
                    None => part,
                };
                // A bounds macro (MMV_BOUNDS) before the name.
                let part = match part.split_once(' ') {
                    Some((w, rest)) if w.ends_with("_BOUNDS") => rest.trim_start(),
                    _ => part,
                };
                let name: String = part.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if part[name.len()..].starts_with("##") || name.is_empty() {
                    continue; // generated per quant type
                }
                defined += 1;
                assert!(
                    KERNEL_NAMES.contains(&name.as_str()),
                    "{file}: kernel {name} is not in KERNEL_NAMES"
                );
            }
        }
        assert!(
            defined > 20,
            "found only {defined} named kernels: the parser no longer matches the sources"
        );
    }

    /// The host sizes the grids of `mmq_*` and `mmq_moe_*` by the rows a block computes: the kernels' tile height
    /// (`MMQ_ROWS`) times their tiles a block (`MMQ_DENSE_RT`, `MMQ_MOE_RT`). A grid sized for fewer rows a block
    /// than the kernel computes is harmless; one sized for more leaves rows unwritten, so the two must agree.
    #[test]
    fn mmq_grids_match_the_kernels_tiles() {
        use super::super::matmul::{MMQ_DENSE_ROWS, MMQ_MOE_ROWS, MMQ_ROWS};
        let src = KERNEL_SOURCES
            .iter()
            .find(|(f, _)| *f == "matvec.cu")
            .expect("matvec.cu in KERNEL_SOURCES")
            .1;
        let value = |decl: &str| -> usize {
            let at = src.find(decl).unwrap_or_else(|| panic!("matvec.cu: no `{decl}`"));
            let rest = &src[at + decl.len()..];
            let digits: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit()).collect();
            digits
                .parse()
                .unwrap_or_else(|_| panic!("matvec.cu: `{decl}` is not followed by a number"))
        };
        assert_eq!(value("#define MMQ_ROWS"), MMQ_ROWS);
        assert_eq!(value("constexpr int MMQ_DENSE_RT =") * MMQ_ROWS, MMQ_DENSE_ROWS);
        assert_eq!(value("constexpr int MMQ_MOE_RT =") * MMQ_ROWS, MMQ_MOE_ROWS);
    }

    /// Every kernel, named or generated by a macro, calls `pdl_enter()` (directly, or through `mmv_fast_rows`,
    /// `mmvt_rows`, `wide_dot_block` or `mmq_tiles`, which call it after their first weight loads, or `mmq_moe`,
    /// which calls it first) before the next kernel
    /// definition: a kernel launched with programmatic dependent launch that never waits would read its inputs
    /// before they are written.
    #[test]
    fn every_kernel_waits_for_the_kernel_before() {
        let mut kernels = 0;
        for (file, src) in KERNEL_SOURCES {
            for part in src.split("__global__ void").skip(1) {
                kernels += 1;
                let head: String = part.chars().take(60).collect();
                // The body: from its opening brace to the matching closing one.
                let open = part.find('{').expect("a kernel body");
                let mut depth = 0;
                let close = part[open..]
                    .char_indices()
                    .find_map(|(i, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        (depth == 0).then_some(open + i)
                    })
                    .expect("a closed kernel body");
                let body = &part[open..close];
                // mmv_fast_rows, mmvt_rows, wide_dot_block and mmq_tiles call pdl_enter after their first weight
                // loads, mmq_moe first.
                assert!(
                    [
                        "pdl_enter()",
                        "mmv_fast_rows<",
                        "mmvt_rows<",
                        "wide_dot_block(",
                        "mmq_tiles<",
                        "mmq_moe<"
                    ]
                    .iter()
                    .any(|c| body.contains(c)),
                    "{file}: kernel `{}` does not call pdl_enter()",
                    head.split('(').next().unwrap_or("").trim()
                );
            }
        }
        assert!(
            kernels > 30,
            "found only {kernels} kernels: the parser no longer matches the sources"
        );
    }
}
