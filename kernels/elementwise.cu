// Element-wise and per-row ops. Each mirrors the CPU backend's function named beside it
// (engine/src/backend/cpu/mod.rs), including its summation precision.

// The RMSNorm scale of a row from its threads' f64 sums of squares: 1 / sqrt(sum / n + eps), in every thread. Every
// thread of the block calls it (it synchronises); blockDim.x a multiple of 32.
__device__ __forceinline__ float rms_scale_block(double ss, int n, float eps) {
    __shared__ double part[32];
    ss = warp_sum_d(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        double s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0;
        s = warp_sum_d(s);
        if (threadIdx.x == 0) part[0] = s;
    }
    __syncthreads();
    return 1.0f / sqrtf((float)(part[0] / n) + eps);
}

// RMSNorm (cpu: rms_norm_row): the mean of squares in f64, out = x * scale * w (out may be x). One block per row
// of n (up to 1024 threads, a multiple of 32).
extern "C" __global__ void rms_norm(const float* x, float* out, const float* __restrict__ w, int n, float eps) {
    pdl_enter();
    const float* row = x + (long long)blockIdx.x * n;
    float* dst = out + (long long)blockIdx.x * n;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)row[i] * (double)row[i];
    float scale = rms_scale_block(ss, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = row[i] * scale * w[i];
}

// RoPE (cpu: rope_token): theta = pos * theta_scale^i by repeated multiplication, as ggml's rope cache.
// One thread per (token, head, rotated pair). neox: pairs (i, i + n_rot/2), else (2i, 2i+1).
extern "C" __global__ void rope(float* __restrict__ x, const unsigned int* __restrict__ pos, int n_tok, int n_head,
                                int head_dim, int n_rot, float theta_scale, float freq_scale, int neox) {
    pdl_enter();
    int half = n_rot / 2;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * n_head * half) return;
    int p = (int)(i % half), h = (int)((i / half) % n_head), t = (int)(i / ((long long)half * n_head));
    float theta = (float)pos[t];
    for (int k = 0; k < p; ++k) theta *= theta_scale;
    float a = freq_scale * theta;
    float cs = cosf(a), sn = sinf(a);
    float* v = x + ((long long)t * n_head + h) * head_dim;
    int i0 = neox ? p : 2 * p, i1 = neox ? p + half : 2 * p + 1;
    float x0 = v[i0], x1 = v[i1];
    v[i0] = x0 * cs - x1 * sn;
    v[i1] = x0 * sn + x1 * cs;
}

extern "C" __global__ void scale_f32(float* __restrict__ x, float s, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// gate = act(gate) * up. act 0: silu (cpu: silu); 1: ggml's f16 GELU (cpu: gelu_ggml).
extern "C" __global__ void glu(float* __restrict__ g, const float* __restrict__ u, long long n, int act) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = glu_act(g[i], act);
    g[i] = a * u[i];
}

// Writes n_tok rows of `width` values into cache cells pos[t] as f16 (row_bytes = 2 * width): rows of the
// layer's pool array dst through the sequence's page table pg (kv_cell).
extern "C" __global__ void kv_store_f16(const float* __restrict__ src, u8* __restrict__ dst,
                                        const u32* __restrict__ pg, const unsigned int* __restrict__ pos,
                                        int n_tok, int width, long long row_bytes) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * width) return;
    int t = (int)(i / width), c = (int)(i % width);
    u16* row = (u16*)(dst + kv_cell(pg, (int)pos[t]) * row_bytes);
    row[c] = f2h(src[i]);
}

// Keys and values of n_tok tokens into their f16 caches in one launch (rows of wk and wv values at cell pos[t],
// through the page table pg).
extern "C" __global__ void kv_store2_f16(const float* __restrict__ sk, u16* __restrict__ dk,
                                         const float* __restrict__ sv, u16* __restrict__ dv,
                                         const u32* __restrict__ pg, const unsigned int* __restrict__ pos,
                                         int n_tok, int wk, int wv) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nk = (long long)n_tok * wk;
    if (i < nk) {
        int t = (int)(i / wk), c = (int)(i % wk);
        dk[kv_cell(pg, (int)pos[t]) * wk + c] = f2h(sk[i]);
    } else if (i < nk + (long long)n_tok * wv) {
        long long j = i - nk;
        int t = (int)(j / wv), c = (int)(j % wv);
        dv[kv_cell(pg, (int)pos[t]) * wv + c] = f2h(sv[j]);
    }
}

// The same as Q8_0 blocks (ggml's quantize_row_q8_0_ref, the CPU's quantize_q8_0): d = amax / 127, codes
// round(x / d) (half away from zero) clamped to [-128, 127], d stored as f16. One warp per block of 32 values,
// lane l quantizing value l: block b of row t is at kv_cell(pg, pos[t]) * row_bytes + 34 * b. Grid: n_tok * width
// / 32 warps.
extern "C" __global__ void kv_store_q8_0(const float* __restrict__ src, u8* __restrict__ dst,
                                         const u32* __restrict__ pg, const unsigned int* __restrict__ pos,
                                         int n_tok, int width, long long row_bytes) {
    pdl_enter();
    int nb = width / 32;
    long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= (long long)n_tok * nb) return; // whole warps: blockDim is a multiple of 32
    int t = (int)(w / nb), b = (int)(w % nb);
    float x = src[(long long)t * width + 32 * b + lane];
    float amax = warp_max(fabsf(x));
    float d = amax / 127.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    int q = (int)roundf(x * id);
    q = q < -128 ? -128 : (q > 127 ? 127 : q);
    u8* blk = dst + kv_cell(pg, (int)pos[t]) * row_bytes + 34LL * b;
    blk[2 + lane] = (u8)(q & 0xFF);
    // The scale as one 16-bit store, as kv_store_f16 writes its values (blocks start at even offsets: row_bytes
    // and 34 * b are even). Storing f2h's result byte by byte lost its low byte on the H200 (sm_90, NVRTC 13.0):
    // every stored scale came back with a zero low byte, a 9% error in the cached values.
    if (lane == 0) *(u16*)blk = f2h(d);
}


// dst[i] = src[i], n values.
extern "C" __global__ void copy_f32(const float* __restrict__ src, float* __restrict__ dst, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// dst[idx[r]][c] = src[r][c] for r < n_rows, c < n: rows computed elsewhere (the CPU's expert misses) into their
// places. One thread per value.
extern "C" __global__ void scatter_rows_f32(const float* __restrict__ src, const u32* __restrict__ idx,
                                            float* __restrict__ dst, int n_rows, int n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * n) return;
    int r = (int)(i / n), c = (int)(i % n);
    dst[(long long)idx[r] * n + c] = src[i];
}

// The MoE router (cpu: route): moe_route_block per token; the probabilities are written back to logits, the
// choice to ids and wts ([n_tok][k]). Grid n_tok, block 256; n_expert <= 1024.
extern "C" __global__ void moe_route(float* __restrict__ logits, u32* __restrict__ ids, float* __restrict__ wts,
                                     int n_expert, int k, int normalize) {
    pdl_enter();
    __shared__ float prob[1024];
    __shared__ u32 ids_s[1024];
    __shared__ float w_s[1024];
    float* row = logits + (long long)blockIdx.x * n_expert;
    moe_route_block(row, n_expert, k, normalize, prob, ids_s, w_s);
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) row[e] = prob[e];
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        ids[(long long)blockIdx.x * k + i] = ids_s[i];
        wts[(long long)blockIdx.x * k + i] = w_s[i];
    }
}

// Token t's weighted sum of its k expert outputs at values i0 and i1 (i1 < 0: none), as moe_ffn sums them:
// sum_j wts[t][j] * d[row(t, j)][i] in f64, j ascending, times inv (1 / the weights' f64 sum when normalised, else
// 1 exactly: the product is then the sum itself), rounded to f32. row(t, j) = rows[t * k + j], or t * k + j without
// rows. The loads go out eight experts at a time for both values before any is summed (one load in flight per
// expert in turn would wait on memory k times).
__device__ __forceinline__ void moe_sum2(const float* __restrict__ d, const u32* __restrict__ rows,
                                         const float* __restrict__ wts, int t, int k, int n, int i0, int i1,
                                         double inv, float* s0, float* s1) {
    double a0 = 0.0, a1 = 0.0;
    for (int j0 = 0; j0 < k; j0 += 8) {
        float v0[8], v1[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int j = j0 + u, slot = t * k + j;
            long long r = j < k ? (rows ? (long long)rows[slot] : (long long)slot) : 0;
            v0[u] = j < k ? d[r * n + i0] : 0.f;
            v1[u] = j < k && i1 >= 0 ? d[r * n + i1] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (j0 + u < k) {
                double w = (double)wts[t * k + j0 + u];
                a0 += w * (double)v0[u];
                a1 += w * (double)v1[u];
            }
    }
    *s0 = (float)(a0 * inv);
    *s1 = (float)(a1 * inv);
}

// 1 / (the f64 sum of token t's k weights) when normalised, else 1.
__device__ __forceinline__ double moe_sum_scale(const float* __restrict__ wts, int t, int k, int normalized) {
    if (!normalized) return 1.0;
    double ws = 0.0;
    for (int j = 0; j < k; ++j) ws += (double)wts[t * k + j];
    return 1.0 / ws;
}

// The weighted sum of the experts' outputs (cpu: moe_ffn): out[t][c] = moe_sum2 of (t, c). One thread per output
// value.
extern "C" __global__ void moe_combine(const float* __restrict__ d, const u32* __restrict__ rows,
                                       const float* __restrict__ wts, float* __restrict__ out, int n_tok, int k,
                                       int n_embd, int normalized) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * n_embd) return;
    int t = (int)(i / n_embd), c = (int)(i % n_embd);
    float s, unused;
    moe_sum2(d, rows, wts, t, k, n_embd, c, -1, moe_sum_scale(wts, t, k, normalized), &s, &unused);
    out[i] = s;
}

// x += y, then out = rms_norm(x) * w (cpu: add, then rms_norm_row on the sum): a residual add and the next norm.
// One block per row of n (up to 1024 threads, a multiple of 32).
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ y, float* __restrict__ out,
                                        const float* __restrict__ w, int n, float eps) {
    pdl_enter();
    float* row = x + (long long)blockIdx.x * n;
    const float* yr = y + (long long)blockIdx.x * n;
    float* dst = out + (long long)blockIdx.x * n;
    double ss = 0.0;
    // Two values per thread per round, both loaded before either is stored (a store to row would otherwise hold
    // the next round's loads back).
    for (int i = threadIdx.x; i < n; i += 2 * blockDim.x) {
        int i1 = i + blockDim.x < n ? i + blockDim.x : -1;
        float a0 = row[i], b0 = yr[i], a1 = i1 >= 0 ? row[i1] : 0.f, b1 = i1 >= 0 ? yr[i1] : 0.f;
        float v0 = a0 + b0;
        row[i] = v0;
        ss += (double)v0 * (double)v0;
        if (i1 >= 0) {
            float v1 = a1 + b1;
            row[i1] = v1;
            ss += (double)v1 * (double)v1;
        }
    }
    float scale = rms_scale_block(ss, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = row[i] * scale * w[i];
}

// A decode step's MoE output into the residual, then the next layer's norm, in one launch (moe_combine, then
// add_rms_norm, with their exact arithmetic): x[t] += sum_i wts[t][i] * d[t * k + i] (f64, divided by the weights'
// f64 sum when `normalized`, rounded to f32), then out[t] = rms_norm(x[t]) * w; without w (the last layer) the add
// alone. One block per token of n values (up to 1024 threads, a multiple of 32).
extern "C" __global__ void moe_combine_add_rms_norm(const float* __restrict__ d, const float* __restrict__ wts,
                                                    float* __restrict__ x, float* __restrict__ out,
                                                    const float* __restrict__ w, int k, int n, int normalized,
                                                    float eps) {
    pdl_enter();
    int t = blockIdx.x;
    float* row = x + (long long)t * n;
    double inv = moe_sum_scale(wts, t, k, normalized);
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += 2 * blockDim.x) {
        int i1 = i + blockDim.x < n ? i + blockDim.x : -1;
        float r0 = row[i], r1 = i1 >= 0 ? row[i1] : 0.f, s0, s1;
        moe_sum2(d, nullptr, wts, t, k, n, i, i1, inv, &s0, &s1);
        float v0 = r0 + s0;
        row[i] = v0;
        ss += (double)v0 * (double)v0;
        if (i1 >= 0) {
            float v1 = r1 + s1;
            row[i1] = v1;
            ss += (double)v1 * (double)v1;
        }
    }
    if (!w) return;
    float scale = rms_scale_block(ss, n, eps);
    float* dst = out + (long long)t * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = row[i] * scale * w[i];
}

// Per-head RMSNorm (when its weights are given) then RoPE of a layer's queries and keys in one launch (cpu:
// rms_norm_row per head, then rope_token). One warp per head row: rows 0 .. n_tok * n_head - 1 are the queries,
// the next n_tok * n_head_kv the keys. With kc given (an f16 KV cache), the rotated keys also go to the cache at
// their positions and n_tok * n_head_kv more rows copy the value heads (vsrc, dv wide) into vc, so the keys and
// values are stored in the same launch (cpu: store_kv), kc and vc being the layer's pool arrays and pg the
// sequence's page table (kv_cell); with kvtab too (a step of several sequences), token t's cache is its own
// sequence's: page table kvtab[3t], arrays kvtab[3t + 1] (keys) and kvtab[3t + 2] (values). Grid ceil(rows / 8),
// block 256.
extern "C" __global__ void qk_norm_rope(float* __restrict__ q, float* __restrict__ k, const float* __restrict__ qw,
                                        const float* __restrict__ kw, const unsigned int* __restrict__ pos,
                                        int n_tok, int n_head, int n_head_kv, int head_dim, float eps, int n_rot,
                                        float theta_scale, float freq_scale, int neox, u16* kc,
                                        const float* __restrict__ vsrc, u16* vc, int dv,
                                        const u32* __restrict__ pg, const unsigned long long* __restrict__ kvtab) {
    pdl_enter();
    long long r = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    long long nq = (long long)n_tok * n_head, nk = (long long)n_tok * n_head_kv;
    if (kc && r >= nq + nk && r < nq + 2 * nk) {
        // A value head, straight into the f16 cache (token t's own with kvtab).
        long long j = r - nq - nk;
        int t = (int)(j / n_head_kv), hv = (int)(j % n_head_kv);
        const float* src = vsrc + j * dv;
        if (kvtab) pg = (const u32*)kvtab[3 * t], vc = (u16*)kvtab[3 * t + 2];
        u16* dst = vc + (kv_cell(pg, (int)pos[t]) * n_head_kv + hv) * dv;
        for (int i = lane; i < dv; i += 32) dst[i] = f2h(src[i]);
        return;
    }
    if (r >= nq + nk) return;
    bool is_q = r < nq;
    float* v = is_q ? q + r * head_dim : k + (r - nq) * head_dim;
    int t = is_q ? (int)(r / n_head) : (int)((r - nq) / n_head_kv);
    head_norm_rope(v, is_q ? qw : kw, head_dim, eps, (int)pos[t], n_rot, theta_scale, freq_scale, neox);
    if (kc && !is_q) {
        // The rotated key, into the f16 cache too.
        long long j = r - nq;
        int hk = (int)(j % n_head_kv);
        if (kvtab) pg = (const u32*)kvtab[3 * t], kc = (u16*)kvtab[3 * t + 1];
        u16* dst = kc + (kv_cell(pg, (int)pos[t]) * n_head_kv + hk) * head_dim;
        for (int i = lane; i < head_dim; i += 32) dst[i] = f2h(v[i]);
    }
}

// dst[i] = src[i] for n4 groups of four floats, 16-byte loads and stores (the bandwidth measurement).
extern "C" __global__ void copy_f32x4(const float4* __restrict__ src, float4* __restrict__ dst, long long n4) {
    pdl_enter();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// The trap of STRATA_FAULT=trap:KERNEL@N (seed 003), launched in KERNEL's place with its grid and block: every
// thread executes a trap instruction, so the context is poisoned as a faulting kernel poisons it, and every later
// call on it fails with the driver's own error.
extern "C" __global__ void strata_trap() {
    pdl_enter();
    __trap();
}
