//! Upcycling: a dense llama model turned into a Mixtral-layout MoE from its own FFN weights.
//!
//! DESIGN.md section 4. Each layer's `ffn_{gate,up,down}` become `ffn_{gate,up,down}_exps` with `n_expert`
//! experts, stacked from the raw blocks of the source tensors with no requantization, plus a random F32 router
//! `ffn_gate_inp`. Two modes:
//! - [`UpcycleMode::Identical`]: every expert of layer i is layer i's FFN. The router's top-k weights are
//!   renormalised to sum to 1 (Mixtral), so the MoE computes exactly the dense model: an exact oracle.
//! - [`UpcycleMode::Shifted`]: expert e of layer i is layer (i + e) mod L's FFN, so experts are distinct real
//!   weights.

use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;

use super::synth::{SynthError, encode_row};
use crate::gguf::{GgufModel, GgufWriter, Value};
use crate::quant::GgmlType;

/// Which FFN each expert takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UpcycleMode {
    /// Every expert of layer i is layer i's FFN.
    Identical,
    /// Expert e of layer i is layer (i + e) mod n_layer's FFN.
    Shifted,
}

/// Parameters of an upcycle.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpcycleSpec {
    pub mode: UpcycleMode,
    pub n_expert: u32,
    /// The router's top-k.
    pub n_expert_used: u32,
    /// Seeds the router weights.
    pub seed: u64,
}

const FFN_PARTS: [&str; 3] = ["ffn_gate", "ffn_up", "ffn_down"];

/// Writes the upcycled MoE of the dense llama model `src` to `dst`. Returns bytes written.
///
/// Errors: `src` is not a dense llama model, a layer lacks an FFN tensor, or (shifted mode) two layers' FFN
/// tensors differ in type or shape so their raw blocks cannot be stacked; each names the tensor.
pub fn upcycle(src: &GgufModel, spec: &UpcycleSpec, dst: &Path) -> Result<u64, SynthError> {
    let src_name = src
        .paths()
        .first()
        .map_or_else(String::new, |p| p.display().to_string());
    let shape_err = |s: String| SynthError::Shape(format!("{src_name}: {s}"));
    if src.paths().iter().any(|p| same_file(p, dst)) {
        return Err(SynthError::Shape(format!(
            "the output {} is the input model; write the MoE to another path",
            dst.display()
        )));
    }
    let md = src.metadata();
    let arch = md.architecture().map_err(|e| shape_err(e.to_string()))?;
    if arch != "llama" {
        return Err(shape_err(format!(
            "upcycling needs a dense llama model; this one is `{arch}`"
        )));
    }
    if md.contains("llama.expert_count") {
        return Err(shape_err(
            "the model already has experts (llama.expert_count is set)".into(),
        ));
    }
    if spec.n_expert > MAX_EXPERTS {
        return Err(shape_err(format!(
            "{} experts is over the upcycler's limit of {MAX_EXPERTS}",
            spec.n_expert
        )));
    }
    if spec.n_expert == 0 || spec.n_expert_used == 0 || spec.n_expert_used > spec.n_expert {
        return Err(shape_err(format!(
            "need 1 <= experts used ({}) <= experts ({})",
            spec.n_expert_used, spec.n_expert
        )));
    }
    let n_layer = md.get_u32("llama.block_count").map_err(|e| shape_err(e.to_string()))?;
    let n_embd = md
        .get_u32("llama.embedding_length")
        .map_err(|e| shape_err(e.to_string()))? as u64;
    let tensor = |name: &str| {
        src.tensor(name)
            .ok_or_else(|| shape_err(format!("tensor {name} is missing")))
    };

    // The source tensor of each expert, checked stackable before anything is written.
    let source_layer = |layer: u32, expert: u32| match spec.mode {
        UpcycleMode::Identical => layer,
        UpcycleMode::Shifted => (layer + expert) % n_layer,
    };
    for layer in 0..n_layer {
        for part in FFN_PARTS {
            let first = tensor(&format!("blk.{layer}.{part}.weight"))?;
            for e in 1..spec.n_expert {
                let other = tensor(&format!("blk.{}.{part}.weight", source_layer(layer, e)))?;
                if other.ty != first.ty || other.dims != first.dims {
                    return Err(shape_err(format!(
                        "cannot stack {} ({} {:?}) with {} ({} {:?}) without requantizing",
                        first.name, first.ty, first.dims, other.name, other.ty, other.dims
                    )));
                }
            }
        }
    }

    // A shard set's split.* keys describe the source files, not the one file written here.
    let mut out_md = crate::gguf::Metadata::new();
    for (key, value) in md.iter().filter(|(k, _)| !k.starts_with("split.")) {
        out_md.insert(key, value.clone());
    }
    out_md.insert("llama.expert_count", Value::U32(spec.n_expert));
    out_md.insert("llama.expert_used_count", Value::U32(spec.n_expert_used));
    let name = md.get("general.name").and_then(Value::as_str).unwrap_or("model");
    let mode = match spec.mode {
        UpcycleMode::Identical => "identical",
        UpcycleMode::Shifted => "shifted",
    };
    out_md.insert(
        "general.name",
        Value::String(format!("{name} upcycled {}x{mode}", spec.n_expert)),
    );

    enum Source<'a> {
        Copy(&'a crate::gguf::TensorInfo),
        Stack { part: &'static str, layer: u32 },
        Router { layer: u32 },
    }
    let mut plan: Vec<(String, Vec<u64>, GgmlType, Source)> = Vec::new();
    for t in src.tensors() {
        let ffn = FFN_PARTS.iter().find_map(|p| {
            let layer = t.name.strip_prefix("blk.")?.strip_suffix(&format!(".{p}.weight"))?;
            Some((*p, layer.parse::<u32>().ok()?))
        });
        match ffn {
            Some((part, layer)) => {
                if part == "ffn_gate" {
                    let dims = vec![n_embd, spec.n_expert as u64];
                    plan.push((
                        format!("blk.{layer}.ffn_gate_inp.weight"),
                        dims,
                        GgmlType::F32,
                        Source::Router { layer },
                    ));
                }
                let mut dims = t.dims.clone();
                dims.push(spec.n_expert as u64);
                plan.push((
                    format!("blk.{layer}.{part}_exps.weight"),
                    dims,
                    t.ty,
                    Source::Stack { part, layer },
                ));
            }
            None => plan.push((t.name.clone(), t.dims.clone(), t.ty, Source::Copy(t))),
        }
    }

    let infos: Vec<_> = plan.iter().map(|(n, d, ty, _)| (n.clone(), d.clone(), *ty)).collect();
    let writer = GgufWriter::create(dst, out_md, infos)?;
    plan.par_iter()
        .enumerate()
        .try_for_each(|(i, (_, _, _, source))| -> Result<(), SynthError> {
            match source {
                Source::Copy(t) => writer.write_tensor(i, src.tensor_data(t))?,
                Source::Stack { part, layer } => {
                    let mut bytes = Vec::new();
                    for e in 0..spec.n_expert {
                        let t = tensor(&format!("blk.{}.{part}.weight", source_layer(*layer, e)))?;
                        bytes.extend_from_slice(src.tensor_data(t));
                    }
                    writer.write_tensor(i, &bytes)?;
                }
                Source::Router { layer } => {
                    let rows = router_rows(spec.seed, *layer, n_embd as usize, spec.n_expert as usize);
                    let mut bytes = vec![0u8; rows.len() * 4];
                    encode_row(GgmlType::F32, &rows, &mut bytes).map_err(shape_err)?;
                    writer.write_tensor(i, &bytes)?;
                }
            }
            Ok(())
        })?;
    Ok(writer.finish()?)
}

/// The most experts per layer an upcycle writes (each stacked tensor is built in memory).
pub const MAX_EXPERTS: u32 = 256;

/// Whether `a` and `b` name the same existing file (device and inode), so writing `b` would replace `a`.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Router weights of one layer, `n_expert` rows of `n_embd`, uniform with RMS 1/√n_embd, seeded per layer.
fn router_rows(seed: u64, layer: u32, n_embd: usize, n_expert: usize) -> Vec<f32> {
    // A 64-bit LCG (Knuth's MMIX constants); plenty for router noise, and stable across versions.
    let mut state = seed ^ ((layer as u64 + 1) << 40) ^ 0x0123_4567_89AB_CDEF;
    let scale = 3f32.sqrt() / (n_embd as f32).sqrt();
    (0..n_embd * n_expert)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}
