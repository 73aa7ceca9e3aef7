//! The weight map: each architecture's tensors, found by name in the GGUF, shape-checked at load, and viewed
//! in place (matrices are never copied; only the small norm vectors are read into f32).
//!
//! Tensor names and shapes follow llama.cpp's `LLM_TENSOR_*` tables and each architecture's
//! `load_arch_tensors` (ggml dims: `dims[0]` is the row length).

use std::path::PathBuf;

use crate::backend::{GluKind, MatRef, QMat, RopeKind, RopeParams};
use crate::gguf::GgufModel;
use crate::model::{Arch, HParams};
use crate::quant::{self, GgmlType};

/// Why a model's weights could not be mapped. Every message names the tensor and the file.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{file}: tensor {name} is missing (needed by the {arch} architecture)")]
    Missing { file: PathBuf, name: String, arch: Arch },
    #[error("{file}: tensor {name} has shape {found:?}, expected {expected:?} from the hyper-parameters")]
    Shape {
        file: PathBuf,
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("{file}: tensor {name} is {ty}, which Strata cannot compute with: {why}")]
    Type {
        file: PathBuf,
        name: String,
        ty: GgmlType,
        why: String,
    },
    #[error("{file}: {what}")]
    Unsupported { file: PathBuf, what: String },
}

/// A layer's feed-forward network.
#[derive(Debug, Clone)]
pub enum Ffn {
    Dense {
        gate: MatRef,
        up: MatRef,
        down: MatRef,
    },
    Moe {
        /// `ffn_gate_inp`: `n_expert` rows of `n_embd`.
        router: MatRef,
        /// `ffn_gate_exps`: `n_expert * n_ff_exp` rows of `n_embd`.
        gate: MatRef,
        up: MatRef,
        /// `ffn_down_exps`: `n_expert * n_embd` rows of `n_ff_exp`.
        down: MatRef,
    },
}

/// A layer's token mixer: what mixes information across positions.
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Causal self-attention over the KV cache (a recurrent mixer, linear attention, joins it with the hybrid
    /// architectures).
    Attention(Attention),
}

/// A self-attention mixer's weights and settings.
#[derive(Debug, Clone)]
pub struct Attention {
    pub wq: MatRef,
    pub wk: MatRef,
    pub wv: MatRef,
    pub wo: MatRef,
    /// Per-head RMSNorm of q and k (qwen3, qwen3moe, gemma3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub rope: RopeParams,
    /// Sliding window of this layer, in tokens (gemma3's local layers).
    pub window: Option<usize>,
}

/// One block: a norm, the mixer, the residual add; a norm, the FFN, the residual add (each sub-block's output
/// optionally normed before its add, as gemma3 does).
#[derive(Debug, Clone)]
pub struct Layer {
    /// Norm of the mixer's input (`attn_norm`).
    pub attn_norm: Vec<f32>,
    pub mixer: Mixer,
    /// Norm of the mixer's output before the residual add (gemma3's `post_attention_norm`).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    /// Norm of the FFN output before the residual add (gemma3).
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// Architecture constants the forward pass follows, derived from the arch and its metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchConfig {
    /// Multiplies the token embeddings (gemma3: √n_embd).
    pub embd_scale: Option<f32>,
    pub act: GluKind,
    /// The attention scale: multiplies q·k before the softmax, or q itself when `attn_scale_on_q`.
    pub attn_scale: f32,
    /// Scale the queries before attention instead of the scores (llama.cpp's gemma3 graph: `Qcur =
    /// ggml_scale(Qcur, f_attention_scale)` with a KQ scale of 1). The two differ only in where an f16 cache
    /// rounds the queries.
    pub attn_scale_on_q: bool,
    /// Renormalise the router's top-k weights to sum 1.
    pub moe_normalize: bool,
}

/// Every weight of a model.
#[derive(Debug, Clone)]
pub struct Weights {
    /// `token_embd`: `vocab` rows of `n_embd`.
    pub token_embd: MatRef,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// `output`, or `token_embd` when the output is tied.
    pub output: MatRef,
    pub config: ArchConfig,
}

struct Loader<'a> {
    gguf: &'a GgufModel,
    arch: Arch,
    file: PathBuf,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&crate::gguf::TensorInfo, WeightsError> {
        self.gguf.tensor(name).ok_or_else(|| WeightsError::Missing {
            file: self.file.clone(),
            name: name.into(),
            arch: self.arch,
        })
    }

    fn check_shape(&self, name: &str, found: &[u64], expected: &[u64]) -> Result<(), WeightsError> {
        if found != expected {
            return Err(WeightsError::Shape {
                file: self.file.clone(),
                name: name.into(),
                found: found.to_vec(),
                expected: expected.to_vec(),
            });
        }
        Ok(())
    }

    /// A matrix with ggml dims `dims` (`dims[0]` the row length; the rest multiply into rows).
    fn mat(&self, name: &str, dims: &[u64]) -> Result<MatRef, WeightsError> {
        let info = self.info(name)?;
        self.check_shape(name, &info.dims, dims)?;
        let cols = dims[0] as usize;
        let rows = dims[1..].iter().product::<u64>() as usize;
        QMat::new(info.ty, self.gguf.tensor_data(info), rows, cols).map_err(|e| WeightsError::Type {
            file: self.file.clone(),
            name: name.into(),
            ty: info.ty,
            why: e.to_string(),
        })?;
        Ok(MatRef {
            info: info.clone(),
            rows,
            cols,
            packed: None,
        })
    }

    /// A vector of `n` values (norm weights), read into f32.
    fn vec(&self, name: &str, n: u64) -> Result<Vec<f32>, WeightsError> {
        let info = self.info(name)?;
        self.check_shape(name, &info.dims, &[n])?;
        let mut out = vec![0.0; n as usize];
        quant::dequantize(info.ty, self.gguf.tensor_data(info), &mut out).map_err(|e| WeightsError::Type {
            file: self.file.clone(),
            name: name.into(),
            ty: info.ty,
            why: e.to_string(),
        })?;
        Ok(out)
    }

    fn opt_vec(&self, name: &str, n: u64) -> Result<Option<Vec<f32>>, WeightsError> {
        if self.gguf.tensor(name).is_some() {
            self.vec(name, n).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Whether gemma3 layer `il` uses the sliding window: `{arch}.attention.sliding_window_pattern` as an array
/// of booleans, or as a period `n` (every n-th layer global, llama.cpp's `set_swa_pattern`), default 6.
fn gemma_is_swa(gguf: &GgufModel, il: u32) -> bool {
    let md = gguf.metadata();
    match md.get("gemma3.attention.sliding_window_pattern") {
        Some(v) if v.as_array().is_some() => v
            .as_array()
            .and_then(|a| a.get(il as usize))
            .and_then(|b| b.as_bool())
            .unwrap_or(false),
        Some(v) => {
            let n = v.as_u64().unwrap_or(6) as u32;
            n == 0 || il % n < n - 1
        }
        None => il % 6 < 5,
    }
}

impl Weights {
    /// Maps the weights of `gguf` for the architecture in `hp`.
    ///
    /// Errors: a missing tensor, a tensor whose shape disagrees with the hyper-parameters, or one of a type
    /// without a dot product; each names the tensor and the file.
    pub fn load(gguf: &GgufModel, hp: &HParams) -> Result<Weights, WeightsError> {
        let file = gguf.paths().first().map(|p| p.to_path_buf()).unwrap_or_default();
        let l = Loader {
            gguf,
            arch: hp.arch,
            file: file.clone(),
        };
        let md = gguf.metadata();
        let (e, v) = (hp.n_embd as u64, hp.vocab_size as u64);
        let (dk, dv) = (hp.head_dim as u64, hp.head_dim_v as u64);
        let (nh, nkv) = (hp.n_head as u64, hp.n_head_kv as u64);
        if hp.head_dim > 1024 || hp.rope_dim > hp.head_dim || !hp.rope_dim.is_multiple_of(2) {
            return Err(WeightsError::Unsupported {
                file,
                what: format!(
                    "head width {} with {} rotated dimensions is not supported (at most 1024, rotated even and ≤ head width)",
                    hp.head_dim, hp.rope_dim
                ),
            });
        }
        let key = |k: &str| format!("{}.{k}", hp.arch.name());
        let get_f32 = |k: &str| md.get(&key(k)).and_then(|v| v.as_f64()).map(|x| x as f32);
        let rope_kind = match hp.arch {
            Arch::Llama => RopeKind::Normal,
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 => RopeKind::Neox,
        };
        let global_rope = RopeParams {
            kind: rope_kind,
            n_rot: hp.rope_dim as usize,
            freq_base: hp.rope_freq_base,
            freq_scale: 1.0 / hp.rope_scale,
        };
        let attn_scale = match (hp.arch, get_f32("attention.scale")) {
            (_, Some(s)) if s != 0.0 => s,
            // llama.cpp: gemma 3 27B (62 layers) scales by n_embd / n_head, the others by the head width.
            (Arch::Gemma3, _) if hp.n_layer == 62 => 1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt(),
            _ => 1.0 / (hp.head_dim as f32).sqrt(),
        };
        let moe_normalize = md
            .get(&key("expert_weights_norm"))
            .and_then(|v| v.as_bool())
            // llama.cpp's llama and qwen3moe graphs pass norm_w = true to build_moe_ffn.
            .unwrap_or(true);
        let config = ArchConfig {
            embd_scale: (hp.arch == Arch::Gemma3).then(|| (hp.n_embd as f32).sqrt()),
            act: if hp.arch == Arch::Gemma3 {
                GluKind::GeGlu
            } else {
                GluKind::SwiGlu
            },
            attn_scale,
            attn_scale_on_q: hp.arch == Arch::Gemma3,
            moe_normalize,
        };
        let has_qk_norm = matches!(hp.arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3);
        let is_gemma = hp.arch == Arch::Gemma3;
        if matches!(hp.arch, Arch::Qwen3Moe) && !hp.is_moe() {
            return Err(WeightsError::Unsupported {
                file,
                what: "qwen3moe needs qwen3moe.expert_count > 0".into(),
            });
        }

        let mut layers = Vec::with_capacity(hp.n_layer as usize);
        for il in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}.weight");
            let ffn = if hp.is_moe() {
                let (x, f) = (hp.n_expert as u64, hp.n_ff_exp as u64);
                Ffn::Moe {
                    router: l.mat(&n("ffn_gate_inp"), &[e, x])?,
                    gate: l.mat(&n("ffn_gate_exps"), &[e, f, x])?,
                    up: l.mat(&n("ffn_up_exps"), &[e, f, x])?,
                    down: l.mat(&n("ffn_down_exps"), &[f, e, x])?,
                }
            } else {
                let f = hp.n_ff as u64;
                Ffn::Dense {
                    gate: l.mat(&n("ffn_gate"), &[e, f])?,
                    up: l.mat(&n("ffn_up"), &[e, f])?,
                    down: l.mat(&n("ffn_down"), &[f, e])?,
                }
            };
            let swa = is_gemma && hp.sliding_window.is_some_and(|w| w > 0) && gemma_is_swa(gguf, il);
            let rope = if swa {
                RopeParams {
                    freq_base: get_f32("rope.freq_base_swa").unwrap_or(10_000.0),
                    freq_scale: 1.0,
                    ..global_rope
                }
            } else {
                global_rope
            };
            let attention = Attention {
                wq: l.mat(&n("attn_q"), &[e, nh * dk])?,
                wk: l.mat(&n("attn_k"), &[e, nkv * dk])?,
                wv: l.mat(&n("attn_v"), &[e, nkv * dv])?,
                wo: l.mat(&n("attn_output"), &[nh * dv, e])?,
                q_norm: if has_qk_norm {
                    Some(l.vec(&n("attn_q_norm"), dk)?)
                } else {
                    None
                },
                k_norm: if has_qk_norm {
                    Some(l.vec(&n("attn_k_norm"), dk)?)
                } else {
                    None
                },
                rope,
                window: if swa {
                    hp.sliding_window.map(|w| w as usize)
                } else {
                    None
                },
            };
            layers.push(Layer {
                attn_norm: l.vec(&n("attn_norm"), e)?,
                mixer: Mixer::Attention(attention),
                post_attn_norm: if is_gemma {
                    Some(l.vec(&n("post_attention_norm"), e)?)
                } else {
                    l.opt_vec(&n("post_attention_norm"), e)?
                },
                ffn_norm: l.vec(&n("ffn_norm"), e)?,
                ffn,
                post_ffn_norm: if is_gemma {
                    Some(l.vec(&n("post_ffw_norm"), e)?)
                } else {
                    None
                },
            });
        }
        let token_embd = l.mat("token_embd.weight", &[e, v])?;
        let output = if gguf.tensor("output.weight").is_some() {
            l.mat("output.weight", &[e, v])?
        } else {
            token_embd.clone()
        };
        Ok(Weights {
            token_embd,
            layers,
            output_norm: l.vec("output_norm.weight", e)?,
            output,
            config,
        })
    }
}
