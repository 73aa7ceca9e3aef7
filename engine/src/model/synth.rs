//! The seeded model generator: GGUF files for each supported architecture at any shape and quant type, with
//! random weights and a controllable router skew.
//!
//! DESIGN.md section 4: no trained MoE is reachable, so benchmark and test MoEs are generated. The same
//! [`SynthSpec`] always gives a byte-identical file: every row of every tensor draws from its own random stream,
//! seeded by (spec seed, tensor name, row), so the thread schedule cannot change a byte.
//!
//! Router skew. Expert popularity follows a Zipf law with exponent `zipf` (0 is uniform). Every token embedding
//! carries a shared direction `u` on top of its noise, and the residual stream keeps it; each router row `e`
//! points along `u` by an amount that makes its logit shift by `-zipf * ln(rank(e))`, with ranks permuted per
//! layer. Softmax then gives expert probabilities roughly proportional to `rank^-zipf`, blurred by the noise
//! part of the logits (standard deviation about 1).

use std::path::Path;

use half::{bf16, f16};
use rayon::prelude::*;
use serde::Serialize;

use crate::gguf::{GgufWriter, Metadata, Value, ValueType};
use crate::quant::{self, GgmlType};

/// Which architecture and tensor layout to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SynthArch {
    /// Dense llama.
    Llama,
    /// Llama with a Mixtral-layout MoE FFN in every layer.
    Mixtral,
    /// Dense qwen3 (q/k-norm).
    Qwen3,
    /// Qwen3 MoE (q/k-norm, experts in every layer).
    Qwen3moe,
}

impl SynthArch {
    /// The `general.architecture` written for this layout (Mixtral-layout MoE is `llama`).
    pub fn gguf_arch(self) -> &'static str {
        match self {
            SynthArch::Llama | SynthArch::Mixtral => "llama",
            SynthArch::Qwen3 => "qwen3",
            SynthArch::Qwen3moe => "qwen3moe",
        }
    }

    /// Whether the FFN is a mixture of experts.
    pub fn is_moe(self) -> bool {
        matches!(self, SynthArch::Mixtral | SynthArch::Qwen3moe)
    }

    fn has_qk_norm(self) -> bool {
        matches!(self, SynthArch::Qwen3 | SynthArch::Qwen3moe)
    }
}

/// Quant type per tensor class. Norms are always F32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TensorTypes {
    /// `token_embd.weight`.
    pub embd: GgmlType,
    /// `output.weight` (absent when the output is tied to the embedding).
    pub output: GgmlType,
    /// `attn_q`, `attn_k`, `attn_v`, `attn_output`.
    pub attn: GgmlType,
    /// Dense `ffn_gate`, `ffn_up`, `ffn_down`.
    pub ffn: GgmlType,
    /// `ffn_{gate,up,down}_exps`.
    pub experts: GgmlType,
    /// The router `ffn_gate_inp`.
    pub router: GgmlType,
}

impl TensorTypes {
    /// Every weight class at `ty`, except the router, which stays F32 as converters write it.
    pub fn uniform(ty: GgmlType) -> TensorTypes {
        TensorTypes {
            embd: ty,
            output: ty,
            attn: ty,
            ffn: ty,
            experts: ty,
            router: GgmlType::F32,
        }
    }
}

/// Everything that determines a generated file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SynthSpec {
    pub arch: SynthArch,
    pub n_layer: u32,
    pub n_embd: u32,
    /// Dense FFN width (ignored by MoE layouts except as metadata).
    pub n_ff: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    /// Q/K/V head width.
    pub head_dim: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    /// Expert FFN width.
    pub n_ff_exp: u32,
    pub vocab_size: u32,
    /// Context length written as `{arch}.context_length`, in tokens.
    pub n_ctx: u32,
    pub rope_freq_base: f32,
    pub types: TensorTypes,
    /// Share `token_embd` as the output projection (no `output.weight`).
    pub tied_output: bool,
    /// Zipf exponent of expert popularity (0: uniform).
    pub zipf: f64,
    pub seed: u64,
}

impl SynthSpec {
    /// A small qwen3moe used by tests and as the synthetic MoE reference model (about 15 MiB at Q8_0).
    pub fn tiny_qwen3moe() -> SynthSpec {
        SynthSpec {
            arch: SynthArch::Qwen3moe,
            n_layer: 4,
            n_embd: 256,
            n_ff: 768,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            n_expert: 16,
            n_expert_used: 4,
            n_ff_exp: 256,
            vocab_size: 2048,
            n_ctx: 4096,
            rope_freq_base: 1_000_000.0,
            types: TensorTypes::uniform(GgmlType::Q8_0),
            tied_output: false,
            zipf: 1.0,
            seed: 1,
        }
    }

    /// Qwen3-30B-A3B's shape (48 layers, n_embd 2048, 128 experts, top-8, n_ff_exp 768, vocab 151936) at Q4_K with
    /// a Q6_K output, the file the H200 benchmarks use (about 17 GB).
    pub fn qwen3_30b_a3b() -> SynthSpec {
        SynthSpec {
            arch: SynthArch::Qwen3moe,
            n_layer: 48,
            n_embd: 2048,
            n_ff: 6144,
            n_head: 32,
            n_head_kv: 4,
            head_dim: 128,
            n_expert: 128,
            n_expert_used: 8,
            n_ff_exp: 768,
            vocab_size: 151_936,
            n_ctx: 40_960,
            rope_freq_base: 1_000_000.0,
            types: TensorTypes {
                output: GgmlType::Q6_K,
                ..TensorTypes::uniform(GgmlType::Q4_K)
            },
            tied_output: false,
            zipf: 1.0,
            seed: 1,
        }
    }

    /// The tensors this spec generates, in file order.
    ///
    /// Errors: a shape the chosen quant types cannot hold (a row length that is not a whole number of blocks),
    /// or an inconsistent head/expert count, naming the tensor or parameter.
    pub fn tensors(&self) -> Result<Vec<SynthTensor>, SynthError> {
        self.validate()?;
        let (e, v) = (self.n_embd as u64, self.vocab_size as u64);
        let (q, kv) = (
            (self.n_head * self.head_dim) as u64,
            (self.n_head_kv * self.head_dim) as u64,
        );
        let t = &self.types;
        let mut out = Vec::new();
        let mut push =
            |name: String, dims: Vec<u64>, ty: GgmlType, fill: Fill| out.push(SynthTensor { name, dims, ty, fill });
        push("token_embd.weight".into(), vec![e, v], t.embd, Fill::Embedding);
        for i in 0..self.n_layer {
            let b = |s: &str| format!("blk.{i}.{s}.weight");
            push(b("attn_norm"), vec![e], GgmlType::F32, Fill::Ones);
            push(b("attn_q"), vec![e, q], t.attn, Fill::Dense);
            push(b("attn_k"), vec![e, kv], t.attn, Fill::Dense);
            push(b("attn_v"), vec![e, kv], t.attn, Fill::Dense);
            push(b("attn_output"), vec![q, e], t.attn, Fill::Residual);
            if self.arch.has_qk_norm() {
                push(b("attn_q_norm"), vec![self.head_dim as u64], GgmlType::F32, Fill::Ones);
                push(b("attn_k_norm"), vec![self.head_dim as u64], GgmlType::F32, Fill::Ones);
            }
            push(b("ffn_norm"), vec![e], GgmlType::F32, Fill::Ones);
            if self.arch.is_moe() {
                let (x, f) = (self.n_expert as u64, self.n_ff_exp as u64);
                push(b("ffn_gate_inp"), vec![e, x], t.router, Fill::Router { layer: i });
                push(b("ffn_gate_exps"), vec![e, f, x], t.experts, Fill::Dense);
                push(b("ffn_up_exps"), vec![e, f, x], t.experts, Fill::Dense);
                push(b("ffn_down_exps"), vec![f, e, x], t.experts, Fill::Residual);
            } else {
                let f = self.n_ff as u64;
                push(b("ffn_gate"), vec![e, f], t.ffn, Fill::Dense);
                push(b("ffn_up"), vec![e, f], t.ffn, Fill::Dense);
                push(b("ffn_down"), vec![f, e], t.ffn, Fill::Residual);
            }
        }
        push("output_norm.weight".into(), vec![e], GgmlType::F32, Fill::Ones);
        if !self.tied_output {
            push("output.weight".into(), vec![e, v], t.output, Fill::Dense);
        }
        for t in &out {
            let bytes = t.dims[1..]
                .iter()
                .try_fold(t.ty.row_bytes(t.dims[0]).unwrap_or(0), |a, &d| a.checked_mul(d));
            if bytes.is_none_or(|b| b > MAX_TENSOR_BYTES) {
                return Err(SynthError::Shape(format!(
                    "tensor {} ({:?} {}) is over the generator's limit of {} GiB per tensor (each is built in memory)",
                    t.name,
                    t.dims,
                    t.ty,
                    MAX_TENSOR_BYTES >> 30
                )));
            }
            if t.ty.row_bytes(t.dims[0]).is_none() {
                return Err(SynthError::Shape(format!(
                    "tensor {} has rows of {} elements, not a whole number of {} blocks ({} elements each)",
                    t.name,
                    t.dims[0],
                    t.ty,
                    t.ty.geometry().block_elems
                )));
            }
            if !quant::can_quantize(t.ty) {
                return Err(SynthError::Shape(format!(
                    "tensor {}: cannot quantize to {} yet",
                    t.name, t.ty
                )));
            }
        }
        Ok(out)
    }

    fn validate(&self) -> Result<(), SynthError> {
        let bad = |what: &str| Err(SynthError::Shape(what.to_string()));
        // Caps well above any real model, so that a typo fails at once instead of allocating terabytes.
        for (name, value, max) in [
            ("n_layer", self.n_layer, 4096),
            ("n_embd", self.n_embd, 1 << 16),
            ("n_ff", self.n_ff, 1 << 18),
            ("n_head", self.n_head, 1024),
            ("n_head_kv", self.n_head_kv, 1024),
            ("head_dim", self.head_dim, 1024),
            ("n_expert", self.n_expert, 1024),
            ("n_ff_exp", self.n_ff_exp, 1 << 18),
            ("vocab_size", self.vocab_size, 1 << 22),
            ("n_ctx", self.n_ctx, 1 << 24),
        ] {
            if value > max {
                return Err(SynthError::Shape(format!(
                    "{name} = {value} is over the generator's limit of {max}"
                )));
            }
        }
        if [
            self.n_layer,
            self.n_embd,
            self.n_head,
            self.n_head_kv,
            self.head_dim,
            self.vocab_size,
        ]
        .contains(&0)
        {
            return bad("n_layer, n_embd, n_head, n_head_kv, head_dim and vocab_size must all be positive");
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad("n_head must be a multiple of n_head_kv");
        }
        if self.vocab_size < SPECIAL_TOKENS.len() as u32 + 256 {
            return bad("vocab_size must hold the 256 byte tokens and the special tokens (at least 259)");
        }
        if self.arch.is_moe() && (self.n_expert == 0 || self.n_expert_used == 0 || self.n_expert_used > self.n_expert) {
            return bad("a MoE needs 1 <= n_expert_used <= n_expert");
        }
        if self.arch.is_moe() && self.n_ff_exp == 0 || !self.arch.is_moe() && self.n_ff == 0 {
            return bad("the FFN width (n_ff, or n_ff_exp for a MoE) must be positive");
        }
        if !(0.0..=MAX_ZIPF).contains(&self.zipf) {
            return bad("zipf must be a number from 0 to 100");
        }
        Ok(())
    }

    /// The metadata written to the file: architecture keys, a byte-level BPE vocabulary and a ChatML template.
    pub fn metadata(&self) -> Metadata {
        let a = self.arch.gguf_arch();
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String(a.into()));
        md.insert(
            "general.name",
            Value::String(format!("strata synthetic {a} (seed {})", self.seed)),
        );
        md.insert("general.alignment", Value::U32(32));
        md.insert("general.quantization_version", Value::U32(2));
        let u = |v: u32| Value::U32(v);
        md.insert(format!("{a}.block_count"), u(self.n_layer));
        md.insert(format!("{a}.context_length"), u(self.n_ctx));
        md.insert(format!("{a}.embedding_length"), u(self.n_embd));
        // llama's MoE layout has no separate expert width: its experts are `feed_forward_length` wide.
        let n_ff = if self.arch == SynthArch::Mixtral {
            self.n_ff_exp
        } else {
            self.n_ff
        };
        md.insert(format!("{a}.feed_forward_length"), u(n_ff));
        md.insert(format!("{a}.attention.head_count"), u(self.n_head));
        md.insert(format!("{a}.attention.head_count_kv"), u(self.n_head_kv));
        md.insert(format!("{a}.attention.key_length"), u(self.head_dim));
        md.insert(format!("{a}.attention.value_length"), u(self.head_dim));
        md.insert(format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
        md.insert(format!("{a}.rope.freq_base"), Value::F32(self.rope_freq_base));
        md.insert(format!("{a}.rope.dimension_count"), u(self.head_dim));
        md.insert(format!("{a}.vocab_size"), u(self.vocab_size));
        if self.arch.is_moe() {
            md.insert(format!("{a}.expert_count"), u(self.n_expert));
            md.insert(format!("{a}.expert_used_count"), u(self.n_expert_used));
            if self.arch == SynthArch::Qwen3moe {
                md.insert(format!("{a}.expert_feed_forward_length"), u(self.n_ff_exp));
            }
        }
        md.insert("strata.synth.zipf", Value::F64(self.zipf));
        md.insert("strata.synth.seed", Value::U64(self.seed));
        synthetic_vocab(
            &mut md,
            self.vocab_size,
            if a == "llama" { "llama-bpe" } else { "qwen2" },
        );
        md
    }

    /// Writes the model to `path`, generating and quantizing rows on all rayon threads. Returns bytes written.
    ///
    /// Errors: an invalid spec ([`SynthError::Shape`]) or a failed write, naming the file.
    pub fn write(&self, path: &Path) -> Result<u64, SynthError> {
        self.write_with(path, false)
    }

    /// [`SynthSpec::write`], with `random_blocks`: the dense and residual projections in Q4_K or Q6_K are written
    /// as random blocks of those types (uniform codes, one sub-block scale, zero-mean weights of the same RMS as
    /// the quantized draw) instead of quantized random floats. About 20x faster to write, for benchmark models
    /// where only the shapes and types matter; embeddings, norms and routers are generated as usual.
    ///
    /// Errors: as [`SynthSpec::write`].
    pub fn write_with(&self, path: &Path, random_blocks: bool) -> Result<u64, SynthError> {
        let tensors = self.tensors()?;
        let infos: Vec<_> = tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.ty)).collect();
        let writer = GgufWriter::create(path, self.metadata(), infos)?;
        for (i, t) in tensors.iter().enumerate() {
            let bytes = self.tensor_bytes(t, random_blocks)?;
            writer.write_tensor(i, &bytes)?;
        }
        Ok(writer.finish()?)
    }

    /// The bytes of one tensor: its rows generated and quantized in parallel.
    fn tensor_bytes(&self, t: &SynthTensor, random_blocks: bool) -> Result<Vec<u8>, SynthError> {
        let row_len = t.dims[0] as usize;
        let n_rows: u64 = t.dims[1..].iter().product();
        let row_bytes = t.ty.row_bytes(t.dims[0]).expect("checked in tensors()") as usize;
        let mut bytes = vec![0u8; row_bytes * n_rows as usize];
        let name_hash = fnv1a(t.name.as_bytes());
        let common = common_direction(self.seed, row_len);
        bytes.par_chunks_mut(row_bytes).enumerate().try_for_each_init(
            || vec![0f32; row_len],
            |row, (r, dst)| {
                let mut rng = SplitMix64::new(self.seed ^ name_hash ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                if random_blocks
                    && let Some(rms) = self.row_rms(t, row.len())
                    && random_block_row(t.ty, rms, &mut rng, dst)
                {
                    return Ok(());
                }
                self.fill_row(t, r, row, &mut rng, &common);
                encode_row(t.ty, row, dst).map_err(|e| SynthError::Shape(format!("tensor {}: {e}", t.name)))
            },
        )?;
        Ok(bytes)
    }

    /// The RMS of a plain random row of `t` (dense and residual projections); `None` for structured fills.
    fn row_rms(&self, t: &SynthTensor, n_in: usize) -> Option<f32> {
        let n_in = n_in as f32;
        match t.fill {
            Fill::Dense => Some(1.0 / n_in.sqrt()),
            Fill::Residual => Some(1.0 / (n_in * 2.0 * self.n_layer as f32).sqrt()),
            _ => None,
        }
    }

    fn fill_row(&self, t: &SynthTensor, r: usize, row: &mut [f32], rng: &mut SplitMix64, common: &[f32]) {
        let n_in = row.len() as f32;
        match t.fill {
            Fill::Ones => row.fill(1.0),
            Fill::Dense => rng.fill_uniform(row, 1.0 / n_in.sqrt()),
            // Projections into the residual stream are scaled by 1/√(2·n_layer) (GPT-2's initialisation), so the
            // stream keeps the embeddings' shared direction through every layer.
            Fill::Residual => rng.fill_uniform(row, 1.0 / (n_in * 2.0 * self.n_layer as f32).sqrt()),
            // Noise of unit RMS plus the shared direction at half that size.
            Fill::Embedding => {
                rng.fill_uniform(row, 1.0);
                for (x, c) in row.iter_mut().zip(common) {
                    *x += 0.5 * c;
                }
            }
            Fill::Router { layer } => {
                rng.fill_uniform(row, 1.0 / n_in.sqrt());
                // The noise part must not see the shared direction, or it would bias each expert by a random,
                // token-independent amount and skew even a zipf-0 router.
                let along = row.iter().zip(common).map(|(w, c)| w * c).sum::<f32>() / n_in;
                for (x, c) in row.iter_mut().zip(common) {
                    *x -= along * c;
                }
                // After RMSNorm a token's projection on the shared direction is about 0.5·√n / 1.118.
                let proj = 0.5 * n_in.sqrt() / 1.118;
                let rank = expert_rank(self.seed, layer, r, self.n_expert as usize);
                let beta = -(self.zipf as f32) * ((rank + 1) as f32).ln() / proj;
                for (x, c) in row.iter_mut().zip(common) {
                    *x += beta * c / n_in.sqrt();
                }
            }
        }
    }
}

/// One tensor of a generated model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthTensor {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    fill: Fill,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    Ones,
    Dense,
    Residual,
    Embedding,
    Router { layer: u32 },
}

/// Why a model could not be generated or upcycled.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid model shape: {0}")]
    Shape(String),
    #[error(transparent)]
    Write(#[from] crate::gguf::GgufWriteError),
    #[error(transparent)]
    Read(#[from] crate::gguf::GgufError),
}

/// Quantizes (or converts) one f32 row into `dst`.
pub(crate) fn encode_row(ty: GgmlType, row: &[f32], dst: &mut [u8]) -> Result<(), String> {
    match ty {
        GgmlType::F32 => dst.copy_from_slice(bytemuck::cast_slice(row)),
        GgmlType::F16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(row) {
                d.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(row) {
                d.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
        }
        _ => quant::quantize(ty, row, dst).map_err(|e| e.to_string())?,
    }
    Ok(())
}

/// Writes random blocks of `ty` with weights of RMS `rms` into `dst` (a whole row); false for types it does not
/// know (the caller quantizes instead). Layouts as ggml's `block_q4_K` (d, dmin, 12 bytes of packed 6-bit
/// scales and mins, 128 bytes of 4-bit codes) and `block_q6_K` (128 bytes of low 4 bits, 64 of high 2 bits, 16
/// int8 scales, d).
fn random_block_row(ty: GgmlType, rms: f32, rng: &mut SplitMix64, dst: &mut [u8]) -> bool {
    let mut fill_random = |bytes: &mut [u8]| {
        for c in bytes.chunks_mut(8) {
            let r = rng.next_u64().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
    };
    match ty {
        GgmlType::Q4_K => {
            // Every sub-block scale and min 32: w = 32·(d·q − dmin) with q uniform in 0..16; dmin = 7.5·d makes
            // the mean 0 and the RMS 32·d·√((16² − 1) / 12).
            let d = rms / (32.0 * (255.0f32 / 12.0).sqrt());
            for b in dst.chunks_exact_mut(144) {
                b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                b[2..4].copy_from_slice(&f16::from_f32(7.5 * d).to_le_bytes());
                b[4..12].fill(0xA0); // scales[0..8]: 32 in the low 6 bits, the high bits of sub-blocks 4..8
                b[12..16].fill(0);
                fill_random(&mut b[16..144]);
            }
            true
        }
        GgmlType::Q6_K => {
            // Every scale 16: w = 16·d·(q − 32) with q uniform in 0..64, RMS 16·d·√((64² − 1) / 12).
            let d = rms / (16.0 * (4095.0f32 / 12.0).sqrt());
            for b in dst.chunks_exact_mut(210) {
                fill_random(&mut b[0..192]);
                b[192..208].fill(16);
                b[208..210].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            }
            true
        }
        _ => false,
    }
}

/// The unit-RMS direction every embedding shares (entries ±1, seeded).
fn common_direction(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed ^ 0xC0FF_EE00_D1EC_7104);
    (0..n)
        .map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 })
        .collect()
}

/// Expert `expert`'s popularity rank (0 = most popular) in `layer`: a seeded permutation per layer.
fn expert_rank(seed: u64, layer: u32, expert: usize, n_expert: usize) -> usize {
    let mut order: Vec<usize> = (0..n_expert).collect();
    let mut rng = SplitMix64::new(seed ^ 0x005E_ED0F_E7E7 ^ ((layer as u64) << 32));
    for i in (1..n_expert).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
        .iter()
        .position(|&e| e == expert)
        .expect("a permutation holds every expert")
}

/// The largest tensor the generator builds (in memory, before writing it), in bytes: 16 GiB.
const MAX_TENSOR_BYTES: u64 = 16 << 30;

/// The largest Zipf exponent: beyond it the router logits' spread overflows f32 and the top expert takes every
/// token anyway.
const MAX_ZIPF: f64 = 100.0;

/// Special tokens of the synthetic vocabulary, after the 256 byte tokens.
const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A byte-level BPE vocabulary: the 256 byte tokens (GPT-2's byte-to-unicode mapping), the ChatML specials, and
/// unused filler tokens up to `vocab_size`; no merges, so every byte is one token.
fn synthetic_vocab(md: &mut Metadata, vocab_size: u32, pre: &str) {
    let mut tokens: Vec<Value> = (0..=255u8)
        .map(|b| Value::String(byte_to_unicode(b).to_string()))
        .collect();
    let mut types = vec![Value::I32(1); 256];
    for s in SPECIAL_TOKENS {
        tokens.push(Value::String(s.into()));
        types.push(Value::I32(3));
    }
    for i in tokens.len()..vocab_size as usize {
        tokens.push(Value::String(format!("<|unused_{i}|>")));
        types.push(Value::I32(5));
    }
    md.insert("tokenizer.ggml.model", Value::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre", Value::String(pre.into()));
    md.insert("tokenizer.ggml.tokens", Value::Array(ValueType::String, tokens));
    md.insert("tokenizer.ggml.token_type", Value::Array(ValueType::I32, types));
    md.insert("tokenizer.ggml.merges", Value::Array(ValueType::String, Vec::new()));
    md.insert("tokenizer.ggml.bos_token_id", Value::U32(256));
    md.insert("tokenizer.ggml.eos_token_id", Value::U32(258));
    md.insert("tokenizer.ggml.padding_token_id", Value::U32(256));
    md.insert("tokenizer.ggml.add_bos_token", Value::Bool(false));
    md.insert("tokenizer.chat_template", Value::String(CHATML_TEMPLATE.into()));
}

/// GPT-2's reversible byte-to-unicode map: printable Latin-1 bytes map to themselves, the rest to U+0100 onwards.
fn byte_to_unicode(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return b as char;
    }
    let offset = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + offset).expect("U+0100..U+0143 are valid chars")
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast, seedable generator; quality is ample for random weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fills `out` uniformly on [-√3·rms, √3·rms], which has RMS `rms`. Two values per draw.
    fn fill_uniform(&mut self, out: &mut [f32], rms: f32) {
        let scale = 3f32.sqrt() * rms / (1u32 << 31) as f32;
        for pair in out.chunks_mut(2) {
            let r = self.next_u64();
            for (k, x) in pair.iter_mut().enumerate() {
                let bits = (r >> (32 * k)) as u32;
                *x = (bits as i32) as f32 * scale;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_blocks_have_the_requested_rms_and_zero_mean() {
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let n = 4096;
            let mut dst = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
            assert!(random_block_row(ty, 0.02, &mut SplitMix64::new(3), &mut dst));
            let mut w = vec![0f32; n];
            quant::dequantize(ty, &dst, &mut w).unwrap();
            let mean = w.iter().sum::<f32>() / n as f32;
            let rms = (w.iter().map(|x| x * x).sum::<f32>() / n as f32).sqrt();
            assert!((rms - 0.02).abs() < 0.002, "{ty}: rms {rms}");
            assert!(mean.abs() < 0.002, "{ty}: mean {mean}");
        }
        assert!(!random_block_row(
            GgmlType::Q8_0,
            0.02,
            &mut SplitMix64::new(3),
            &mut [0u8; 34]
        ));
    }

    #[test]
    fn byte_map_is_a_bijection_onto_gpt2_chars() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_to_unicode).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_to_unicode(b' '), 'Ġ');
        assert_eq!(byte_to_unicode(b'\n'), 'Ċ');
        assert_eq!(byte_to_unicode(b'a'), 'a');
    }

    #[test]
    fn uniform_fill_has_the_requested_rms() {
        let mut rng = SplitMix64::new(7);
        let mut v = vec![0f32; 100_000];
        rng.fill_uniform(&mut v, 0.25);
        let rms = (v.iter().map(|x| (x * x) as f64).sum::<f64>() / v.len() as f64).sqrt();
        assert!((rms - 0.25).abs() < 0.005, "rms {rms}");
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.005, "mean {mean}");
    }

    #[test]
    fn expert_ranks_are_a_permutation_that_differs_by_layer() {
        let ranks = |layer| (0..32).map(|e| expert_rank(3, layer, e, 32)).collect::<Vec<_>>();
        let mut sorted = ranks(0);
        sorted.sort();
        assert_eq!(sorted, (0..32).collect::<Vec<_>>());
        assert_ne!(ranks(0), ranks(1));
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_tensor() {
        let mut spec = SynthSpec::tiny_qwen3moe();
        spec.types.experts = GgmlType::Q4_K;
        spec.n_ff_exp = 100;
        let err = spec.tensors().unwrap_err().to_string();
        assert!(err.contains("ffn_down_exps") || err.contains("ffn_gate_exps"), "{err}");
        let mut spec = SynthSpec::tiny_qwen3moe();
        spec.n_expert_used = 17;
        assert!(spec.tensors().unwrap_err().to_string().contains("n_expert_used"));
    }
}
