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

use crate::backend::{AttnOp, AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RunBufs};
use crate::experts::store::{ArenaError, ExpertStore, LayerTensors};
use crate::experts::trace::{TraceError, TraceWriter};
use crate::gguf::{GgufError, GgufModel};
use crate::model::weights::{Ffn, Mixer, Weights, WeightsError};
use crate::model::{HParams, HParamsError};
use crate::state::batch::BatchLayout;
use crate::state::kv::KvCache;

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

/// A loaded model: the mapped file, its hyper-parameters, its weight map, and the store its routed experts are
/// read from (in place from the file until [`Model::use_arena`]).
pub struct Model {
    pub gguf: GgufModel,
    pub hp: HParams,
    pub weights: Weights,
    pub experts: ExpertStore,
    /// Where every forward step's routing is written (`--dump-routing`), if anywhere.
    routing_dump: Option<std::sync::Mutex<RoutingDump>>,
}

/// A routing trace written as the forward pass routes ([`Model::dump_routing`]).
struct RoutingDump {
    writer: TraceWriter,
    /// A write failed (said once, and kept for [`Model::routing_dump_error`]): nothing more is written.
    failed: Option<String>,
    ids: Vec<u32>,
}

impl RoutingDump {
    /// Records what the MoE op just run at `layer` chose for the step's tokens at `positions`.
    fn record<B: Backend>(&mut self, be: &B, moe: &MoeScratch, layer: usize, positions: &[u32], k: usize) {
        if self.failed.is_some() {
            return;
        }
        be.routed_experts(moe, positions.len(), k, &mut self.ids);
        let written = positions
            .iter()
            .zip(self.ids.chunks_exact(k))
            .try_for_each(|(&pos, experts)| self.writer.record(layer as u32, pos as u64, experts));
        self.fail_on(written);
    }

    /// Reports a failed write once and stops writing.
    fn fail_on(&mut self, r: Result<(), TraceError>) {
        if let Err(e) = r {
            eprintln!("strata: --dump-routing: {e}; no more routing is written");
            self.failed = Some(e.to_string());
        }
    }
}

/// Which tokens of a batch need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token of each sequence of the step: `[runs][vocab]` (one sequence: its last token's `vocab`
    /// values).
    Last,
    /// Every token: `[n_tok][vocab]` (teacher forcing).
    All,
    /// The last token's best candidates only, selected by the backend ([`Backend::top_logits`]) into
    /// [`Scratch::top`] (a step of several sequences: each one's into [`Scratch::tops`]); a backend that does not
    /// select returns the values as `Last` does.
    Top,
}

/// What a forward pass left for [`Model::read_logits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardOut {
    /// The backend queued its selection of the best logits ([`Logits::Top`]).
    pub topped: bool,
}

/// Activation buffers of the forward pass, where backend `B` computes (device memory on a GPU), grown to the
/// largest batch seen and reused, so decode steps allocate nothing. `logits` is on the host.
pub struct Scratch<B: Backend> {
    x: B::Buf,
    h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    o: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    router: B::Buf,
    lg: B::Buf,
    moe: MoeScratch,
    /// Per-run copies for steps of several sequences.
    runs: RunBufs<B::Buf>,
    pub logits: Vec<f32>,
    /// The last step's candidates when it ran with [`Logits::Top`] and the backend selected them (`logits` is
    /// then empty).
    pub top: crate::backend::TopLogits,
    /// The same for a step of several sequences: one per sequence, in the layout's order.
    pub tops: Vec<crate::backend::TopLogits>,
}

impl<B: Backend> Default for Scratch<B> {
    fn default() -> Self {
        Scratch {
            x: B::Buf::default(),
            h: B::Buf::default(),
            q: B::Buf::default(),
            k: B::Buf::default(),
            v: B::Buf::default(),
            att: B::Buf::default(),
            o: B::Buf::default(),
            gate: B::Buf::default(),
            up: B::Buf::default(),
            router: B::Buf::default(),
            lg: B::Buf::default(),
            moe: MoeScratch::default(),
            runs: RunBufs::default(),
            logits: Vec::new(),
            top: Default::default(),
            tops: Vec::new(),
        }
    }
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
        let layers = weights
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Moe { gate, up, down, .. } => Some(LayerTensors {
                    gate: gate.info.clone(),
                    up: up.info.clone(),
                    down: down.info.clone(),
                }),
                Ffn::Dense { .. } => None,
            })
            .collect();
        let experts = ExpertStore::mmap(layers, hp.n_expert as usize);
        Ok(Model {
            gguf,
            hp,
            weights,
            experts,
            routing_dump: None,
        })
    }

    /// Writes every forward step's routing to `writer` from now on (`--dump-routing`): each MoE layer's top-k for
    /// each token of the step, read from the backend after the layer ([`Backend::routed_experts`]). A failed
    /// write is reported once and ends the dump, never the step.
    pub fn dump_routing(&mut self, writer: TraceWriter) {
        self.routing_dump = Some(std::sync::Mutex::new(RoutingDump {
            writer,
            failed: None,
            ids: Vec::new(),
        }));
    }

    /// The write error that ended the routing dump ([`Model::dump_routing`]), if one did: a command that was
    /// asked for the dump then exits with an error, since what the user asked for was not all written.
    pub fn routing_dump_error(&self) -> Option<String> {
        let d = self.routing_dump.as_ref()?;
        d.lock().unwrap_or_else(|p| p.into_inner()).failed.clone()
    }

    /// Whether forward steps write their routing ([`Model::dump_routing`]): such steps read the routing back
    /// mid-step, so they are not recorded as graphs.
    pub fn dumps_routing(&self) -> bool {
        self.routing_dump.is_some()
    }

    /// Moves the routed experts into a host arena ([`ExpertStore::make_arena`]): the forward pass then reads them
    /// from there, with the same bytes, so every result is unchanged. `progress(copied, total)` follows the copy.
    ///
    /// Errors: [`ArenaError`]; the model keeps reading the experts in place.
    pub fn use_arena(&mut self, available: Option<u64>, progress: impl FnMut(u64, u64)) -> Result<(), ArenaError> {
        self.experts.make_arena(&self.gguf, available, progress)
    }

    /// Every weight a device keeps resident whatever the expert cache does, as the bytes the forward pass hands
    /// the backend: the matrices (embeddings, attention, dense FFNs, routers, output head) and the norm vectors.
    /// The routed experts are not among them. `layers`: the layers the device computes (`0..n_layer`, or a stage's of a
    /// layer split: the embeddings go with layer 0, the output norm and head with the last layer).
    pub fn dense_weight_bytes(&self, layers: &std::ops::Range<usize>) -> Vec<&[u8]> {
        fn norm(v: &[f32]) -> &[u8] {
            bytemuck::cast_slice(v)
        }
        let w = &self.weights;
        let mut out = Vec::new();
        if layers.start == 0 {
            out.push(self.m(&w.token_embd).data);
        }
        if layers.end >= w.layers.len() {
            out.extend([self.m(&w.output).data, norm(&w.output_norm)]);
        }
        for l in w.layers.get(layers.clone()).unwrap_or_default() {
            let Mixer::Attention(at) = &l.mixer;
            out.extend([&at.wq, &at.wk, &at.wv, &at.wo].map(|r| self.m(r).data));
            out.extend(
                [&at.q_norm, &at.k_norm, &l.post_attn_norm, &l.post_ffn_norm]
                    .into_iter()
                    .flatten()
                    .map(|v| norm(v)),
            );
            out.extend([norm(&l.attn_norm), norm(&l.ffn_norm)]);
            match &l.ffn {
                Ffn::Dense { gate, up, down } => out.extend([gate, up, down].map(|r| self.m(r).data)),
                Ffn::Moe { router, .. } => out.push(self.m(router).data),
            }
        }
        out
    }

    #[inline]
    fn m<'a>(&'a self, r: &'a crate::backend::MatRef) -> QMat<'a> {
        r.view(&self.gguf)
    }

    /// Packs the dense matrices the CPU's matmul reads every step (attention, dense FFNs, the output head) eight
    /// rows at a time ([`crate::quant::packed`]) where their type has a packed layout, and releases the file's
    /// pages of each once packed ([`crate::backend::MatRef::pack`]; the token embeddings' rows are still read
    /// from the file). Returns how many matrices were packed and their bytes. Routed experts and routers are left
    /// as they are.
    ///
    /// Errors: the packed copies would take more than `limit` bytes (host memory to spare); nothing is packed, and
    /// the error is the bytes they would take.
    pub fn pack_for_cpu(&mut self, limit: Option<u64>) -> Result<(usize, u64), u64> {
        let gguf = &self.gguf;
        let w = &mut self.weights;
        let mut mats: Vec<&mut crate::backend::MatRef> = vec![&mut w.output];
        for l in &mut w.layers {
            let Mixer::Attention(at) = &mut l.mixer;
            mats.extend([&mut at.wq, &mut at.wk, &mut at.wv, &mut at.wo]);
            if let Ffn::Dense { gate, up, down } = &mut l.ffn {
                mats.extend([gate, up, down]);
            }
        }
        let need: u64 = mats
            .iter()
            .filter_map(|m| crate::quant::packed::packed_len(m.info.ty, m.info.n_bytes as usize, m.rows, m.cols))
            .map(|n| n as u64)
            .sum();
        if limit.is_some_and(|l| need > l) {
            return Err(need);
        }
        let (mut n, mut bytes) = (0, 0);
        for m in mats {
            if m.pack(gguf) {
                n += 1;
                bytes += m.packed.as_ref().map_or(0, |p| p.bytes.len() as u64);
            }
        }
        Ok((n, bytes))
    }

    /// How many of `layers` have routed experts.
    pub fn moe_layers_in(&self, layers: &std::ops::Range<usize>) -> usize {
        self.weights
            .layers
            .get(layers.clone())
            .unwrap_or_default()
            .iter()
            .filter(|l| matches!(l.ffn, Ffn::Moe { .. }))
            .count()
    }

    /// Layer `il`'s routed experts, viewed where the expert store keeps them (the arena, or the mapped file);
    /// `None` for a layer without routed experts or out of range.
    pub fn layer_experts(&self, il: usize) -> Option<Experts<'_>> {
        let Ffn::Moe { gate, up, down, .. } = &self.weights.layers.get(il)?.ffn else {
            return None;
        };
        let [gb, ub, db] = self.experts.layer(il, &self.gguf)?;
        let from_store = |r: &crate::backend::MatRef, bytes| {
            QMat::new(r.info.ty, bytes, r.rows, r.cols).expect("expert tensors checked at load")
        };
        Some(Experts {
            gate: from_store(gate, gb),
            up: from_store(up, ub),
            down: from_store(down, db),
            n_expert: self.hp.n_expert as usize,
            n_ff_exp: self.hp.n_ff_exp as usize,
            act: self.weights.config.act,
            layer: il,
        })
    }

    /// Runs one step: `tokens`, laid out by `layout` (each run's tokens at its positions, its keys and values
    /// written into its sequence's cache `kvs[run.seq]`), and leaves the requested logits for
    /// [`Model::read_logits`]: nothing, the last token of each run (`[runs][vocab]`), or `[n_tok][vocab]`; with
    /// [`Logits::Top`] on a one-sequence step, the backend's candidates when it selects them.
    ///
    /// This is the forward pass alone: the step driver (`runtime::session`) brackets it for backends that record
    /// steps ([`Backend::step_begin`]) and reads the logits with [`Model::read_logits`].
    ///
    /// Panics when the layout does not match `tokens`, a run does not fit its cache, or an id is outside the
    /// vocabulary (the session checks these and reports them as errors).
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        tokens: &[u32],
        layout: &BatchLayout,
        kvs: &mut [&mut KvCache],
        s: &mut Scratch<B>,
        logits: Logits,
    ) -> ForwardOut {
        // Not while dumping routing: the pass holds the dump's lock, and a worker waiting for its tasks may start
        // another pass on this model (work stealing), which would wait for that lock under the first.
        if be.forward_on_rayon() && self.routing_dump.is_none() && rayon::current_thread_index().is_none() {
            return crate::backend::progress::on_rayon(|| self.forward(be, tokens, layout, kvs, s, logits));
        }
        let hp = &self.hp;
        let w = &self.weights;
        let n = tokens.len();
        assert!(n > 0 && layout.n_tok() == n, "forward: the layout is not the tokens'");
        be.step_sequences(layout.runs().len());
        let mut dump = self
            .routing_dump
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(d) = dump.as_deref_mut() {
            d.writer.begin_step();
        }
        for run in layout.runs() {
            assert!(
                run.seq < kvs.len() && run.pos0 + run.len <= kvs[run.seq].n_ctx(),
                "forward: tokens beyond the cache"
            );
        }
        let (e, nh, nkv) = (hp.n_embd as usize, hp.n_head as usize, hp.n_head_kv as usize);
        let (dk, dv) = (hp.head_dim as usize, hp.head_dim_v as usize);
        // A layer split starts every step on its first stage.
        be.enter_layer(0);
        self.reserve_step(be, s, n);

        let embd = self.m(&w.token_embd);
        for &id in tokens {
            assert!(
                (id as usize) < embd.rows,
                "forward: token id {id} outside the vocabulary"
            );
        }

        let out = self.m(&w.output);
        // Embeddings: one dequantized row of token_embd per token.
        be.get_rows(&embd, tokens, &mut s.x);
        if let Some(sc) = w.config.embd_scale {
            be.scale(&mut s.x, n * e, sc);
        }

        trace(be, "inp_embd", None, &s.x, n * e);
        // Each layer's attn_norm is computed with the residual add that ends the layer before it.
        if let Some(l0) = w.layers.first() {
            be.rms_norm_into(&s.x, &mut s.h, n, &l0.attn_norm, hp.rms_eps);
        }
        for (il, layer) in w.layers.iter().enumerate() {
            crate::backend::progress::tick();
            if crate::backend::progress::stop_here() {
                // A cancelled prefill chunk (Session::prefill_cancellable): the caller drops the whole chunk.
                return ForwardOut { topped: false };
            }
            if be.enter_layer(il) {
                // The next stage of a layer split: its buffers, and the residual stream with this layer's
                // attn_norm of it (computed with the add that ended the layer before).
                self.reserve_step(be, s, n);
                be.carry(&mut s.x, n * e);
                be.carry(&mut s.h, n * e);
                be.carried();
            }
            trace(be, "attn_norm", Some(il), &s.h, n * e);
            // The mixer: attention (the one mixer so far).
            let Mixer::Attention(at) = &layer.mixer;
            be.matmul_many(
                &[self.m(&at.wq), self.m(&at.wk), self.m(&at.wv)],
                &s.h,
                n,
                &mut [&mut s.q, &mut s.k, &mut s.v],
            );
            trace(be, "Qcur", Some(il), &s.q, n * nh * dk);
            trace(be, "Kcur", Some(il), &s.k, n * nkv * dk);
            trace(be, "Vcur", Some(il), &s.v, n * nkv * dv);
            let op = AttnOp {
                norms: (at.q_norm.as_deref(), at.k_norm.as_deref()),
                eps: hp.rms_eps,
                rope: &at.rope,
                params: AttnParams {
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: dk,
                    head_dim_v: dv,
                    // gemma3 scales the rotated queries before attention.
                    scale: if w.config.attn_scale_on_q {
                        1.0
                    } else {
                        w.config.attn_scale
                    },
                    window: at.window,
                },
                q_scale: w.config.attn_scale_on_q.then_some(w.config.attn_scale),
            };
            be.attend_runs(&mut s.q, &mut s.k, &s.v, kvs, il, layout, &op, &mut s.att, &mut s.runs);
            trace(be, "kqv_out", Some(il), &s.att, n * nh * dv);
            be.matmul(&self.m(&at.wo), &s.att, n, &mut s.o);
            trace(be, "attn_out", Some(il), &s.o, n * e);
            if let Some(pn) = &layer.post_attn_norm {
                be.rms_norm(&mut s.o, n, pn, hp.rms_eps);
            }
            be.add_rms_norm_into(&mut s.x, &s.o, &mut s.h, n, &layer.ffn_norm, hp.rms_eps);
            trace(be, "ffn_norm", Some(il), &s.h, n * e);
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    let gm = self.m(gate);
                    let f = n * gm.rows;
                    be.matmul_many(&[gm, self.m(up)], &s.h, n, &mut [&mut s.gate, &mut s.up]);
                    trace(be, "ffn_gate", Some(il), &s.gate, f);
                    trace(be, "ffn_up", Some(il), &s.up, f);
                    be.glu(&mut s.gate, &s.up, f, w.config.act);
                    let glu_name = match w.config.act {
                        GluKind::SwiGlu => "ffn_swiglu",
                        GluKind::GeGlu => "ffn_geglu",
                    };
                    trace(be, glu_name, Some(il), &s.gate, f);
                    be.matmul(&self.m(down), &s.gate, n, &mut s.o);
                    trace(be, "ffn_out", Some(il), &s.o, n * e);
                }
                Ffn::Moe { router, .. } => {
                    let router = self.m(router);
                    let ex = self.layer_experts(il).expect("a MoE layer's experts");
                    if layer.post_ffn_norm.is_none() && !*TRACE_TENSORS {
                        // The router, the experts' sum, the residual add and the next layer's attn_norm (a
                        // backend may fuse them).
                        let next = w.layers.get(il + 1).map(|l| &l.attn_norm[..]);
                        be.moe_add_rms_norm(
                            &router,
                            &ex,
                            &mut s.router,
                            &mut s.h,
                            n,
                            hp.n_expert_used as usize,
                            w.config.moe_normalize,
                            &mut s.o,
                            &mut s.x,
                            next,
                            hp.rms_eps,
                            &mut s.moe,
                        );
                        if let Some(d) = dump.as_deref_mut() {
                            d.record(be, &s.moe, il, layout.positions(), hp.n_expert_used as usize);
                        }
                        continue;
                    }
                    be.matmul(&router, &s.h, n, &mut s.router);
                    be.moe(
                        &ex,
                        &mut s.router,
                        &s.h,
                        n,
                        hp.n_expert_used as usize,
                        w.config.moe_normalize,
                        &mut s.o,
                        &mut s.moe,
                    );
                    if let Some(d) = dump.as_deref_mut() {
                        d.record(be, &s.moe, il, layout.positions(), hp.n_expert_used as usize);
                    }
                    trace(be, "ffn_moe_out", Some(il), &s.o, n * e);
                }
            }
            if let Some(pn) = &layer.post_ffn_norm {
                be.rms_norm(&mut s.o, n, pn, hp.rms_eps);
            }
            match w.layers.get(il + 1) {
                Some(next) => be.add_rms_norm_into(&mut s.x, &s.o, &mut s.h, n, &next.attn_norm, hp.rms_eps),
                None => be.add(&mut s.x, &s.o, n * e),
            }
        }
        if let Some(d) = dump.as_deref_mut()
            && d.failed.is_none()
        {
            let flushed = d.writer.flush();
            d.fail_on(flushed);
        }
        drop(dump);

        let m = match logits {
            Logits::None => return ForwardOut { topped: false },
            Logits::Last | Logits::Top => {
                for (i, run) in layout.runs().iter().enumerate() {
                    be.copy(&s.x, (run.start + run.len - 1) * e, &mut s.o, i * e, e);
                }
                layout.runs().len()
            }
            Logits::All => {
                be.copy(&s.x, 0, &mut s.o, 0, n * e);
                n
            }
        };
        be.rms_norm_into(&s.o, &mut s.h, m, &w.output_norm, hp.rms_eps);
        be.reserve(&mut s.lg, m * out.rows);
        be.matmul(&out, &s.h, m, &mut s.lg);
        trace(be, "result_norm", None, &s.h, m * e);
        trace(be, "result_output", None, &s.lg, m * out.rows);
        let topped = logits == Logits::Top
            && if m == 1 {
                be.top_logits(&s.lg, out.rows)
            } else {
                be.top_logits_rows(&s.lg, m, out.rows)
            };
        ForwardOut { topped }
    }

    /// The logits a step laid out by `layout` left, as [`Model::forward`] describes them: read from the
    /// backend's buffer into `scratch.logits`, or the candidates it selected into `scratch.top` (`topped`: the
    /// step queued that selection; then nothing is returned when the backend has it).
    pub fn read_logits<'s, B: Backend>(
        &self,
        be: &B,
        s: &'s mut Scratch<B>,
        logits: Logits,
        layout: &BatchLayout,
        topped: bool,
    ) -> &'s [f32] {
        let rows = self.weights.output.rows;
        if logits == Logits::None {
            return &[];
        }
        if topped {
            let m = layout.runs().len();
            let read = if m == 1 {
                be.read_top_logits(rows, &mut s.top)
            } else {
                s.tops.resize_with(m, Default::default);
                be.read_top_logits_rows(rows, &mut s.tops)
            };
            if read {
                return &[];
            }
        }
        let len = match logits {
            Logits::All => layout.n_tok(),
            _ => layout.runs().len(),
        } * rows;
        if s.logits.len() < len {
            s.logits.resize(len, 0.0);
        }
        be.download(&s.lg, 0, &mut s.logits[..len]);
        &s.logits[..len]
    }

    /// Sizes a step's activation buffers for `n` tokens (on a layer split, the current stage's).
    fn reserve_step<B: Backend>(&self, be: &B, s: &mut Scratch<B>, n: usize) {
        let hp = &self.hp;
        let (e, nh, nkv) = (hp.n_embd as usize, hp.n_head as usize, hp.n_head_kv as usize);
        let (dk, dv) = (hp.head_dim as usize, hp.head_dim_v as usize);
        let (n_ff, nx) = (self.max_ff(), hp.n_expert as usize);
        for (buf, len) in [
            (&mut s.x, n * e),
            (&mut s.h, n * e),
            (&mut s.q, n * nh * dk),
            (&mut s.k, n * nkv * dk),
            (&mut s.v, n * nkv * dv),
            (&mut s.att, n * nh * dv),
            (&mut s.o, n * e),
            (&mut s.gate, n * n_ff),
            (&mut s.up, n * n_ff),
            (&mut s.router, n * nx.max(1)),
        ] {
            be.reserve(buf, len);
        }
    }

    /// The widest FFN of any layer (dense `n_ff`; 0 for MoE layers, whose buffers the backend keeps).
    fn max_ff(&self) -> usize {
        self.weights
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Dense { gate, .. } => gate.rows,
                Ffn::Moe { .. } => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// Set `STRATA_TRACE_TENSORS=1` to print one line per intermediate tensor of every forward pass to stderr:
/// `tensor NAME-LAYER n=N first=[..] last=[..] sum=S`, named like llama.cpp's graph nodes (`attn_norm-3`,
/// `Qcur-3` before q-norm and RoPE, `kqv_out-3`, `ffn_out-3`, `result_output`; `inp_embd` is the scaled
/// embedding), so a run can be compared
/// line by line with llama.cpp's `llama-eval-callback` on the same prompt (fixtures/llamacpp/compare_tensors.py).
/// A diagnostic for numerical divergences; it costs one relaxed load per call when off.
pub static TRACE_TENSORS: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| crate::switches::flag(crate::switches::TRACE_TENSORS, false));

/// Prints the first `len` values of `buf` (all tokens of the batch, row-major) when tensor tracing is on; see
/// [`TRACE_TENSORS`]. The values are downloaded from the backend only then.
fn trace<B: Backend>(be: &B, name: &str, il: Option<usize>, buf: &B::Buf, len: usize) {
    if !*TRACE_TENSORS || len == 0 {
        return;
    }
    let mut host = vec![0.0f32; len];
    be.download(buf, 0, &mut host);
    let v = &host[..];
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
