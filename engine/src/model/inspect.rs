//! `strata inspect`: what a GGUF model holds, for people and (as JSON) for tools.

use std::collections::BTreeMap;

use serde::Serialize;

use super::hparams::HParams;
use crate::gguf::{GgufModel, Metadata};
use crate::quant::GgmlType;
use crate::tokenizer::{ChatTemplate, Tokenizer};

/// A model's description: architecture, hyper-parameters, tokenizer, tensors and totals (`strata inspect` adds
/// the memory plan's estimate, `crate::memory::MemoryEstimate`).
#[derive(Debug, Clone, Serialize)]
pub struct ModelSummary {
    /// The files of the model (several for a shard set).
    pub files: Vec<String>,
    /// Sum of the files' sizes, in bytes.
    pub file_bytes: u64,
    /// `general.architecture`.
    pub architecture: String,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Hyper-parameters; `None` with `hparams_error` set when they cannot be read (an unsupported architecture
    /// is still inspectable).
    pub hparams: Option<HParams>,
    pub hparams_error: Option<String>,
    pub tokenizer: TokenizerSummary,
    pub tensors: Vec<TensorRow>,
    /// Per quant type: tensor count, elements and bytes, in type-id order.
    pub totals_by_type: Vec<TypeTotal>,
    /// Every metadata key with a short rendering of its value (long arrays abbreviated).
    pub metadata: Vec<(String, String)>,
}

/// The tokenizer as the metadata declares it.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizerSummary {
    /// `tokenizer.ggml.model` (`gpt2` for byte-level BPE, `llama` for SentencePiece).
    pub model: Option<String>,
    /// `tokenizer.ggml.pre`, the pre-tokenizer of a BPE vocabulary.
    pub pre: Option<String>,
    /// Number of tokens in `tokenizer.ggml.tokens`.
    pub n_tokens: usize,
    /// Number of BPE merges.
    pub n_merges: usize,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub add_bos_token: Option<bool>,
    /// Whether `tokenizer.chat_template` is present.
    pub chat_template: bool,
    /// Why the tokenizer cannot be built from this metadata, if it cannot.
    pub error: Option<String>,
    /// Why the chat template does not compile, if it does not (the engine refuses such a model at load).
    pub chat_template_error: Option<String>,
}

/// One tensor: name, type, shape in ggml order (row length first), and bytes.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub shape: Vec<u64>,
    pub bytes: u64,
}

/// The tensors of one quant type.
#[derive(Debug, Clone, Serialize)]
pub struct TypeTotal {
    #[serde(rename = "type")]
    pub ty: String,
    pub tensors: usize,
    pub elements: u64,
    pub bytes: u64,
}

impl ModelSummary {
    /// Describes `model`.
    pub fn new(model: &GgufModel) -> ModelSummary {
        let md = model.metadata();
        let hparams = HParams::from_metadata(md).map_err(|e| e.to_string());
        let tensors: Vec<TensorRow> = model
            .tensors()
            .iter()
            .map(|t| TensorRow {
                name: t.name.clone(),
                ty: t.ty.name().into(),
                shape: t.dims.clone(),
                bytes: t.n_bytes,
            })
            .collect();
        let mut totals: BTreeMap<GgmlType, TypeTotal> = BTreeMap::new();
        for t in model.tensors() {
            let e = totals.entry(t.ty).or_insert_with(|| TypeTotal {
                ty: t.ty.name().into(),
                tensors: 0,
                elements: 0,
                bytes: 0,
            });
            e.tensors += 1;
            e.elements = e.elements.saturating_add(t.n_elements());
            e.bytes = e.bytes.saturating_add(t.n_bytes);
        }
        ModelSummary {
            files: model.paths().iter().map(|p| p.display().to_string()).collect(),
            file_bytes: model
                .paths()
                .iter()
                .filter_map(|p| std::fs::metadata(p).ok())
                .map(|m| m.len())
                .sum(),
            architecture: md
                .architecture()
                .unwrap_or("(missing general.architecture)")
                .to_string(),
            name: md.get("general.name").and_then(|v| v.as_str()).map(String::from),
            hparams_error: hparams.as_ref().err().cloned(),
            hparams: hparams.ok(),
            tokenizer: TokenizerSummary::new(md),
            tensors,
            totals_by_type: totals.into_values().collect(),
            metadata: md.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// The human-readable report `strata inspect` prints.
    pub fn to_text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let w = &mut s;
        let _ = writeln!(w, "file         {}", self.files.join(", "));
        let _ = writeln!(w, "size         {}", human_bytes(self.file_bytes));
        let _ = writeln!(w, "architecture {}", self.architecture);
        if let Some(name) = &self.name {
            let _ = writeln!(w, "name         {name}");
        }
        match &self.hparams {
            Some(h) => {
                let _ = writeln!(w, "\nhyper-parameters");
                let rows: Vec<(&str, String)> = vec![
                    ("n_layer", h.n_layer.to_string()),
                    ("n_embd", h.n_embd.to_string()),
                    ("n_ff", h.n_ff.to_string()),
                    ("n_head", h.n_head.to_string()),
                    ("n_head_kv", h.n_head_kv.to_string()),
                    ("head_dim", format!("{} (v {})", h.head_dim, h.head_dim_v)),
                    ("n_ctx_train", h.n_ctx_train.to_string()),
                    ("n_vocab", h.vocab_size.to_string()),
                    ("rms_eps", format!("{:e}", h.rms_eps)),
                    (
                        "rope",
                        format!("base {}, dims {}, scale {}", h.rope_freq_base, h.rope_dim, h.rope_scale),
                    ),
                ];
                for (k, v) in rows {
                    let _ = writeln!(w, "  {k:<12} {v}");
                }
                if h.is_moe() {
                    let _ = writeln!(
                        w,
                        "  {:<12} {} (top-{} used, n_ff_exp {})",
                        "n_expert", h.n_expert, h.n_expert_used, h.n_ff_exp
                    );
                }
                if let Some(sw) = h.sliding_window {
                    let _ = writeln!(w, "  {:<12} {sw}", "sliding_win");
                }
            }
            None => {
                let e = self.hparams_error.as_deref().unwrap_or("unknown");
                let _ = writeln!(w, "\nhyper-parameters: {e}");
            }
        }
        let t = &self.tokenizer;
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let _ = writeln!(
            w,
            "\ntokenizer    {} (pre {}), {} tokens, {} merges",
            opt(&t.model),
            opt(&t.pre),
            t.n_tokens,
            t.n_merges
        );
        let id = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
        let _ = writeln!(
            w,
            "             bos {}, eos {}, add_bos {}, chat template {}",
            id(t.bos_token_id),
            id(t.eos_token_id),
            t.add_bos_token.map_or("-".into(), |b| b.to_string()),
            match (t.chat_template, &t.chat_template_error) {
                (_, Some(_)) => "present but broken",
                (true, None) => "present",
                (false, None) => "absent",
            }
        );
        if let Some(e) = &t.error {
            let _ = writeln!(w, "             tokenizer error: {e}");
        }
        if let Some(e) = &t.chat_template_error {
            let _ = writeln!(w, "             chat template error: {e}");
        }
        let name_w = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
        let _ = writeln!(
            w,
            "\n{:<name_w$}  {:<7}  {:<24}  {:>12}",
            "tensor", "type", "shape", "bytes"
        );
        for t in &self.tensors {
            let shape = format!("{:?}", t.shape);
            let _ = writeln!(w, "{:<name_w$}  {:<7}  {:<24}  {:>12}", t.name, t.ty, shape, t.bytes);
        }
        let _ = writeln!(
            w,
            "\n{:<7}  {:>7}  {:>14}  {:>12}",
            "type", "tensors", "elements", "size"
        );
        for t in &self.totals_by_type {
            let _ = writeln!(
                w,
                "{:<7}  {:>7}  {:>14}  {:>12}",
                t.ty,
                t.tensors,
                t.elements,
                human_bytes(t.bytes)
            );
        }
        s
    }
}

impl TokenizerSummary {
    fn new(md: &Metadata) -> TokenizerSummary {
        let s = |k: &str| md.get(k).and_then(|v| v.as_str()).map(String::from);
        let len = |k: &str| md.get(k).and_then(|v| v.as_array()).map_or(0, <[_]>::len);
        TokenizerSummary {
            model: s("tokenizer.ggml.model"),
            pre: s("tokenizer.ggml.pre"),
            n_tokens: len("tokenizer.ggml.tokens"),
            n_merges: len("tokenizer.ggml.merges"),
            bos_token_id: md.get("tokenizer.ggml.bos_token_id").and_then(|v| v.as_u64()),
            eos_token_id: md.get("tokenizer.ggml.eos_token_id").and_then(|v| v.as_u64()),
            add_bos_token: md.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()),
            chat_template: md.contains("tokenizer.chat_template"),
            error: Tokenizer::from_metadata(md).err().map(|e| e.to_string()),
            chat_template_error: ChatTemplate::from_metadata(md).err().map(|e| e.to_string()),
        }
    }
}

/// `n` bytes in binary units (KiB = 2^10, MiB = 2^20, GiB = 2^30).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
