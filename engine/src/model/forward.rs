//! The forward pass: one function for every supported architecture, written against [`Backend`].
//!
//! Per layer (llama.cpp's `src/models/{llama,qwen3,qwen3moe,gemma3}.cpp`):
//!
//! ```text
//! h = rms_norm(x, attn_norm)
//! q, k, v = h·Wq, h·Wk, h·Wv            (q/k: per-head rms_norm when the arch has q/k-norm)
//! q, k = rope(q), rope(k)               (normal for llama, neox otherwise; gemma3 local layers: base 10000)
//! cache k, v;  a = attention(q, cache)  (GQA, causal, sliding window on gemma3 local layers)
//! o = a·Wo                              (gemma3: rms_norm(o, post_attention_norm))
//! x = x + o
//! h = rms_norm(x, ffn_norm)
//! f = down(act(gate(h)) * up(h))        (MoE: softmax router, top-k, renormalised, weighted sum of experts)
//! x = x + f                             (gemma3: rms_norm(f, post_ffw_norm) first)
//! ```
//!
//! then `logits = rms_norm(x, output_norm)·Woutput` for the tokens that need them. gemma3 scales the token
//! embeddings by √n_embd and uses GeGLU (gelu-tanh); its norms are stored with the +1 already applied (the
//! converter adds it), so every arch uses the plain `x · w` RMSNorm.

use std::path::Path;

use crate::backend::{AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, Routing};
use crate::gguf::{GgufError, GgufModel};
use crate::model::weights::{Ffn, Weights, WeightsError};
use crate::model::{HParams, HParamsError};
use crate::quant;
use crate::runtime::kv::KvCache;

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{file}: {source}")]
    HParams { file: String, source: HParamsError },
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

/// A loaded model: the mapped file, its hyper-parameters and its weight map.
pub struct Model {
    pub gguf: GgufModel,
    pub hp: HParams,
    pub weights: Weights,
}

/// Which tokens of a batch need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token only: `vocab` values.
    Last,
    /// Every token: `[n_tok][vocab]` (teacher forcing).
    All,
}

/// Activation buffers of the forward pass, grown to the largest batch seen and reused, so decode steps
/// allocate nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    pos: Vec<u32>,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    router: Vec<f32>,
    routing: Routing,
    moe: MoeScratch,
    pub logits: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl Model {
    /// Opens a GGUF (any shard of a set) and maps its weights.
    ///
    /// Errors: the file cannot be read or parsed; an unsupported architecture (listing the supported ones);
    /// missing or misshapen tensors (naming them).
    pub fn load(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        let gguf = GgufModel::open(path.as_ref())?;
        Model::from_gguf(gguf)
    }

    /// Maps the weights of an opened GGUF.
    ///
    /// Errors: as [`Model::load`].
    pub fn from_gguf(gguf: GgufModel) -> Result<Model, ModelError> {
        let hp = HParams::from_metadata(gguf.metadata()).map_err(|source| ModelError::HParams {
            file: gguf
                .paths()
                .first()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            source,
        })?;
        let weights = Weights::load(&gguf, &hp)?;
        Ok(Model { gguf, hp, weights })
    }

    #[inline]
    fn m<'a>(&'a self, r: &crate::backend::MatRef) -> QMat<'a> {
        r.view(&self.gguf)
    }

    /// Runs `tokens` at positions `pos0..pos0 + tokens.len()`, writing their keys and values into `kv`, and
    /// returns the requested logits (`scratch.logits`): nothing, the last token's `vocab` values, or
    /// `[n_tok][vocab]`.
    ///
    /// Panics when the tokens do not fit the cache or an id is outside the vocabulary (the session checks
    /// both and reports them as errors).
    pub fn forward<'s, B: Backend>(
        &self,
        be: &B,
        tokens: &[u32],
        pos0: usize,
        kv: &mut KvCache,
        s: &'s mut Scratch,
        logits: Logits,
    ) -> &'s [f32] {
        let hp = &self.hp;
        let w = &self.weights;
        let n = tokens.len();
        assert!(n > 0 && pos0 + n <= kv.n_ctx(), "forward: tokens beyond the cache");
        let (e, nh, nkv) = (hp.n_embd as usize, hp.n_head as usize, hp.n_head_kv as usize);
        let (dk, dv) = (hp.head_dim as usize, hp.head_dim_v as usize);
        s.pos.clear();
        s.pos.extend((pos0..pos0 + n).map(|p| p as u32));

        // Embeddings: one dequantized row of token_embd per token.
        let embd = self.m(&w.token_embd);
        let x = sized(&mut s.x, n * e);
        for (t, &id) in tokens.iter().enumerate() {
            assert!(
                (id as usize) < embd.rows,
                "forward: token id {id} outside the vocabulary"
            );
            quant::dequantize(embd.ty, embd.row(id as usize), &mut x[t * e..(t + 1) * e])
                .expect("embedding checked at load");
        }
        if let Some(sc) = w.config.embd_scale {
            be.scale(x, sc);
        }

        trace("inp_embd", None, &s.x[..n * e]);
        for (il, layer) in w.layers.iter().enumerate() {
            let x = &mut s.x[..n * e];
            let h = sized(&mut s.h, n * e);
            h.copy_from_slice(x);
            be.rms_norm(h, &layer.attn_norm, hp.rms_eps);
            trace("attn_norm", Some(il), h);

            let q = sized(&mut s.q, n * nh * dk);
            let k = sized(&mut s.k, n * nkv * dk);
            let v = sized(&mut s.v, n * nkv * dv);
            be.matmul_many(
                &[self.m(&layer.wq), self.m(&layer.wk), self.m(&layer.wv)],
                h,
                n,
                &mut [&mut *q, &mut *k, &mut *v],
            );
            trace("Qcur", Some(il), q);
            trace("Kcur", Some(il), k);
            trace("Vcur", Some(il), v);
            if let Some(qn) = &layer.q_norm {
                be.rms_norm(q, qn, hp.rms_eps);
            }
            if let Some(kn) = &layer.k_norm {
                be.rms_norm(k, kn, hp.rms_eps);
            }
            be.rope(q, nh, dk, &s.pos, &layer.rope);
            be.rope(k, nkv, dk, &s.pos, &layer.rope);
            let cache = &mut kv.layers[il];
            be.store_kv(cache, k, v, &s.pos);
            let att = sized(&mut s.att, n * nh * dv);
            let scale = if w.config.attn_scale_on_q {
                be.scale(q, w.config.attn_scale);
                1.0
            } else {
                w.config.attn_scale
            };
            let params = AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: dk,
                head_dim_v: dv,
                scale,
                window: layer.window,
            };
            be.attention(q, cache, &s.pos, &params, att);
            trace("kqv_out", Some(il), att);
            let o = sized(&mut s.o, n * e);
            be.matmul(&self.m(&layer.wo), att, n, o);
            trace("attn_out", Some(il), o);
            if let Some(pn) = &layer.post_attn_norm {
                be.rms_norm(o, pn, hp.rms_eps);
            }
            be.add(x, o);

            h.copy_from_slice(x);
            be.rms_norm(h, &layer.ffn_norm, hp.rms_eps);
            trace("ffn_norm", Some(il), h);
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    let gm = self.m(gate);
                    let g = sized(&mut s.gate, n * gm.rows);
                    let u = sized(&mut s.up, n * gm.rows);
                    be.matmul_many(&[gm, self.m(up)], h, n, &mut [&mut *g, &mut *u]);
                    trace("ffn_gate", Some(il), g);
                    trace("ffn_up", Some(il), u);
                    be.glu(g, u, w.config.act);
                    let glu_name = match w.config.act {
                        GluKind::SwiGlu => "ffn_swiglu",
                        GluKind::GeGlu => "ffn_geglu",
                    };
                    trace(glu_name, Some(il), g);
                    be.matmul(&self.m(down), g, n, o);
                    trace("ffn_out", Some(il), o);
                }
                Ffn::Moe { router, gate, up, down } => {
                    let nx = hp.n_expert as usize;
                    let r = sized(&mut s.router, n * nx);
                    be.matmul(&self.m(router), h, n, r);
                    be.route(r, nx, hp.n_expert_used as usize, w.config.moe_normalize, &mut s.routing);
                    let ex = Experts {
                        gate: self.m(gate),
                        up: self.m(up),
                        down: self.m(down),
                        n_expert: nx,
                        n_ff_exp: hp.n_ff_exp as usize,
                        act: w.config.act,
                    };
                    be.moe_ffn(&ex, h, &s.routing, o, &mut s.moe);
                }
            }
            if let Some(pn) = &layer.post_ffn_norm {
                be.rms_norm(o, pn, hp.rms_eps);
            }
            be.add(x, o);
        }

        let (first, m) = match logits {
            Logits::None => return &[],
            Logits::Last => (n - 1, 1),
            Logits::All => (0, n),
        };
        let h = sized(&mut s.h, m * e);
        h.copy_from_slice(&s.x[first * e..(first + m) * e]);
        be.rms_norm(h, &w.output_norm, hp.rms_eps);
        let out = self.m(&w.output);
        let lg = sized(&mut s.logits, m * out.rows);
        be.matmul(&out, h, m, lg);
        trace("result_norm", None, h);
        trace("result_output", None, lg);
        &s.logits[..m * out.rows]
    }
}

/// Set `STRATA_TRACE_TENSORS=1` to print one line per intermediate tensor of every forward pass to stderr:
/// `tensor NAME-LAYER n=N first=[..] last=[..] sum=S`, named like llama.cpp's graph nodes (`attn_norm-3`,
/// `Qcur-3` before q-norm and RoPE, `kqv_out-3`, `ffn_out-3`, `result_output`; `inp_embd` is the scaled
/// embedding), so a run can be compared
/// line by line with llama.cpp's `llama-eval-callback` on the same prompt (fixtures/llamacpp/compare_tensors.py).
/// A diagnostic for numerical divergences; it costs one relaxed load per call when off.
static TRACE_TENSORS: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var_os("STRATA_TRACE_TENSORS").is_some_and(|v| v != "0"));

/// Prints `v` (all tokens of the batch, row-major) when tensor tracing is on; see [`TRACE_TENSORS`].
fn trace(name: &str, il: Option<usize>, v: &[f32]) {
    if !*TRACE_TENSORS || v.is_empty() {
        return;
    }
    let sum: f64 = v.iter().map(|&x| x as f64).sum();
    let k = v.len().min(3);
    let fmt = |xs: &[f32]| xs.iter().map(|x| format!("{x:.6}")).collect::<Vec<_>>().join(", ");
    let layer = il.map(|i| format!("-{i}")).unwrap_or_default();
    eprintln!(
        "tensor {name}{layer} n={} first=[{}] last=[{}] sum={sum:.6}",
        v.len(),
        fmt(&v[..k]),
        fmt(&v[v.len() - k..])
    );
}
