//! Hyper-parameters of the supported architectures, read from GGUF metadata only.
//!
//! Source: the GGUF specification's "LLM" keys (`{arch}.block_count`, `{arch}.attention.head_count`...) and
//! llama.cpp's `llm_load_hparams` for the defaults each architecture assumes when a key is absent.

use std::fmt;

use serde::Serialize;

use crate::gguf::{Metadata, MetadataError};

/// An architecture Strata runs, named by `general.architecture`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama, dense or with a Mixtral-layout MoE FFN (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`).
    Llama,
    /// Qwen3 dense (q/k-norm).
    Qwen3,
    /// Qwen3 MoE (q/k-norm, softmax router over all experts, top-k, optional weight normalisation).
    Qwen3Moe,
    /// Gemma 3 (sliding-window attention, post-norms, embedding scale, GeGLU).
    Gemma3,
}

impl Arch {
    /// Every supported architecture.
    pub const ALL: [Arch; 4] = [Arch::Llama, Arch::Qwen3, Arch::Qwen3Moe, Arch::Gemma3];

    /// The `general.architecture` string, which also prefixes the architecture's metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// The architecture named `name`, or `None` when Strata does not support it.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why hyper-parameters could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HParamsError {
    #[error(
        "unsupported architecture `{found}` (general.architecture); supported: {}",
        supported()
    )]
    UnsupportedArch { found: String },
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error("metadata key `{key}` = {value} is invalid: {why}")]
    Invalid {
        key: String,
        value: String,
        why: &'static str,
    },
}

/// The largest dimension (layers, width, heads, experts, vocabulary...) accepted from metadata.
const MAX_DIM: u32 = 1 << 24;

fn supported() -> String {
    Arch::ALL.map(Arch::name).join(", ")
}

/// The hyper-parameters a forward pass needs, all from metadata.
///
/// Dimensions are element counts; `head_dim` is the per-head width of Q and K, `head_dim_v` of V.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HParams {
    pub arch: Arch,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layer: u32,
    /// Context length the model was trained with, in tokens (`{arch}.context_length`).
    pub n_ctx_train: u32,
    /// Residual stream width (`{arch}.embedding_length`).
    pub n_embd: u32,
    /// Dense FFN width (`{arch}.feed_forward_length`); 0 when the model has only experts.
    pub n_ff: u32,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_head: u32,
    /// Key/value heads (`{arch}.attention.head_count_kv`, default `n_head`): GQA groups `n_head / n_head_kv`.
    pub n_head_kv: u32,
    /// Q/K head width (`{arch}.attention.key_length`, default `n_embd / n_head`).
    pub head_dim: u32,
    /// V head width (`{arch}.attention.value_length`, default `head_dim`).
    pub head_dim_v: u32,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// RoPE base frequency θ (`{arch}.rope.freq_base`, default 10000).
    pub rope_freq_base: f32,
    /// RoPE linear scale factor (`{arch}.rope.scaling.factor` when the type is linear, else 1).
    pub rope_scale: f32,
    /// Rotated dimensions per head (`{arch}.rope.dimension_count`, default `head_dim`).
    pub rope_dim: u32,
    /// Experts per MoE layer (`{arch}.expert_count`); 0 for a dense model.
    pub n_expert: u32,
    /// Experts used per token, the router's top-k (`{arch}.expert_used_count`).
    pub n_expert_used: u32,
    /// Expert FFN width (`{arch}.expert_feed_forward_length`, default `n_ff`).
    pub n_ff_exp: u32,
    /// Sliding-window size in tokens for the local attention layers (gemma3), if any.
    pub sliding_window: Option<u32>,
    /// Vocabulary size (`{arch}.vocab_size`, else the length of `tokenizer.ggml.tokens`).
    pub vocab_size: u32,
}

impl HParams {
    /// Reads the hyper-parameters of the architecture named by `general.architecture`.
    ///
    /// Errors: an unsupported architecture (listing the supported ones), a missing required key, a key of the
    /// wrong type, or inconsistent values (e.g. `n_head` not a multiple of `n_head_kv`), each naming the key.
    pub fn from_metadata(md: &Metadata) -> Result<HParams, HParamsError> {
        let arch_name = md.architecture()?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| HParamsError::UnsupportedArch {
            found: arch_name.into(),
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let opt_u32 = |k: &str| -> Result<Option<u32>, HParamsError> {
            let k = key(k);
            if md.contains(&k) {
                Ok(Some(md.get_u32(&k)?))
            } else {
                Ok(None)
            }
        };
        let opt_f32 = |k: &str| -> Result<Option<f32>, HParamsError> {
            let k = key(k);
            if md.contains(&k) {
                Ok(Some(md.get_f32(&k)?))
            } else {
                Ok(None)
            }
        };
        // Dimensions past 2^24 are not models but corrupt or hostile files; refusing them keeps every size
        // computed from them (products of a few dimensions) far from overflow.
        let positive = |k: &str, v: u32| -> Result<u32, HParamsError> {
            match v {
                0 => Err(HParamsError::Invalid {
                    key: key(k),
                    value: v.to_string(),
                    why: "must be positive",
                }),
                v if v > MAX_DIM => Err(HParamsError::Invalid {
                    key: key(k),
                    value: v.to_string(),
                    why: "is implausibly large (over 2^24)",
                }),
                v => Ok(v),
            }
        };
        let finite_positive = |k: &str, v: f32| -> Result<f32, HParamsError> {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(HParamsError::Invalid {
                    key: key(k),
                    value: v.to_string(),
                    why: "must be a finite positive number",
                })
            }
        };

        let n_layer = positive("block_count", md.get_u32(&key("block_count"))?)?;
        let n_embd = positive("embedding_length", md.get_u32(&key("embedding_length"))?)?;
        let n_head = positive("attention.head_count", md.get_u32(&key("attention.head_count"))?)?;
        let n_head_kv = positive(
            "attention.head_count_kv",
            opt_u32("attention.head_count_kv")?.unwrap_or(n_head),
        )?;
        if n_head % n_head_kv != 0 {
            return Err(HParamsError::Invalid {
                key: key("attention.head_count_kv"),
                value: n_head_kv.to_string(),
                why: "must divide attention.head_count",
            });
        }
        let head_dim = match opt_u32("attention.key_length")? {
            Some(v) => positive("attention.key_length", v)?,
            None if n_embd < n_head => {
                return Err(HParamsError::Invalid {
                    key: key("attention.head_count"),
                    value: n_head.to_string(),
                    why: "exceeds embedding_length, so the head width (embedding_length / head_count) would be 0",
                });
            }
            None => n_embd / n_head,
        };
        let head_dim_v = positive(
            "attention.value_length",
            opt_u32("attention.value_length")?.unwrap_or(head_dim),
        )?;
        let bounded = |k: &str| -> Result<u32, HParamsError> {
            match opt_u32(k)? {
                Some(v) if v > 0 => positive(k, v),
                other => Ok(other.unwrap_or(0)),
            }
        };
        let n_ff = bounded("feed_forward_length")?;
        let n_expert = bounded("expert_count")?;
        let n_expert_used = bounded("expert_used_count")?;
        if n_expert > 0 && (n_expert_used == 0 || n_expert_used > n_expert) {
            return Err(HParamsError::Invalid {
                key: key("expert_used_count"),
                value: n_expert_used.to_string(),
                why: "must be between 1 and expert_count for a MoE model",
            });
        }
        let n_ff_exp = match bounded("expert_feed_forward_length")? {
            0 => n_ff,
            v => v,
        };
        let rms_eps = finite_positive(
            "attention.layer_norm_rms_epsilon",
            md.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        )?;
        let rope_scale = match md.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            Some("linear") => opt_f32("rope.scaling.factor")?.unwrap_or(1.0),
            _ => 1.0,
        };
        let vocab_size = match opt_u32("vocab_size")? {
            Some(v) => positive("vocab_size", v)?,
            None => md.get_array("tokenizer.ggml.tokens")?.len().min(u32::MAX as usize) as u32,
        };
        Ok(HParams {
            arch,
            n_layer,
            n_ctx_train: opt_u32("context_length")?.unwrap_or(0),
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            rms_eps,
            rope_freq_base: finite_positive("rope.freq_base", opt_f32("rope.freq_base")?.unwrap_or(10_000.0))?,
            rope_scale,
            rope_dim: opt_u32("rope.dimension_count")?.unwrap_or(head_dim),
            n_expert,
            n_expert_used,
            n_ff_exp,
            sliding_window: opt_u32("attention.sliding_window")?,
            vocab_size,
        })
    }

    /// Whether the FFN is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }

    /// The attention geometry a KV cache is sized from.
    pub fn kv_shape(&self) -> crate::state::kv::KvShape {
        crate::state::kv::KvShape {
            n_layer: self.n_layer as usize,
            n_head_kv: self.n_head_kv as usize,
            head_dim: self.head_dim as usize,
            head_dim_v: self.head_dim_v as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;

    fn llama_md() -> Metadata {
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String("llama".into()));
        for (k, v) in [
            ("block_count", 30),
            ("embedding_length", 576),
            ("feed_forward_length", 1536),
            ("attention.head_count", 9),
            ("attention.head_count_kv", 3),
            ("context_length", 8192),
            ("vocab_size", 49152),
        ] {
            md.insert(format!("llama.{k}"), Value::U32(v));
        }
        md.insert("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        md
    }

    #[test]
    fn defaults_follow_the_architecture() {
        let hp = HParams::from_metadata(&llama_md()).unwrap();
        assert_eq!((hp.head_dim, hp.head_dim_v, hp.rope_dim), (64, 64, 64));
        assert_eq!(hp.rope_freq_base, 10_000.0);
        assert!(!hp.is_moe());
        // 30 layers × 3 heads × (64 + 64) × 2 bytes.
        assert_eq!(hp.kv_shape().cell_bytes(crate::state::kv::KvType::F16), Ok(23_040));
    }

    #[test]
    fn unsupported_arch_lists_the_supported_ones() {
        let mut md = llama_md();
        md.insert("general.architecture", Value::String("mamba".into()));
        let err = HParams::from_metadata(&md).unwrap_err().to_string();
        assert!(
            err.contains("mamba") && err.contains("qwen3moe") && err.contains("gemma3"),
            "{err}"
        );
    }

    #[test]
    fn inconsistent_values_name_the_key() {
        let mut md = llama_md();
        md.insert("llama.attention.head_count_kv", Value::U32(4));
        let err = HParams::from_metadata(&md).unwrap_err().to_string();
        assert!(err.contains("llama.attention.head_count_kv"), "{err}");
        let mut md = llama_md();
        md.insert("llama.expert_count", Value::U32(8));
        let err = HParams::from_metadata(&md).unwrap_err().to_string();
        assert!(err.contains("llama.expert_used_count"), "{err}");
        let mut md = llama_md();
        md.insert("llama.block_count", Value::String("30".into()));
        assert!(
            HParams::from_metadata(&md)
                .unwrap_err()
                .to_string()
                .contains("llama.block_count")
        );
        let mut md = llama_md();
        md.insert("llama.attention.key_length", Value::U32(u32::MAX));
        assert!(
            HParams::from_metadata(&md)
                .unwrap_err()
                .to_string()
                .contains("implausibly large")
        );
        let mut md = llama_md();
        md.insert("llama.attention.layer_norm_rms_epsilon", Value::F32(f32::NAN));
        assert!(
            HParams::from_metadata(&md)
                .unwrap_err()
                .to_string()
                .contains("layer_norm_rms_epsilon")
        );
        let mut md = llama_md();
        md.insert("llama.attention.head_count", Value::U32(1000));
        md.insert("llama.attention.head_count_kv", Value::U32(1000));
        let err = HParams::from_metadata(&md).unwrap_err().to_string();
        assert!(
            err.contains("llama.attention.head_count") && !err.contains("key_length"),
            "{err}"
        );
    }
}
