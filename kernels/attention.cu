// Causal GQA attention over the cache, in three passes that keep the CPU's rounding (cpu: Backend::attention):
// scores (q.k, with q rounded to f16 against an f16 cache), an exact softmax per row (sum in f64) whose
// probabilities are rounded to f16 against an f16 cache, then P.V split over the keys (split-K) and summed.
// Cache rows: cell j holds heads * head_bytes bytes; ty 0 = f16, 1 = Q8_0 (34-byte blocks of 32). A cache is its
// layer's pool array (k or v: rows of every sequence's blocks) and the sequence's page table (pg): cell j is row
// kv_cell(pg, j) of the array (common.cuh).

__device__ __forceinline__ float kv_load(const u8* base, const u32* pg, long long row_bytes, int head_bytes, int ty,
                                         int cell, int head, int d) {
    const u8* h = base + kv_cell(pg, cell) * row_bytes + (long long)head * head_bytes;
    if (ty == 0) return h2f(((const u16*)h)[d]);
    const u8* b = h + 34 * (d >> 5);
    return h2f(ld16(b)) * (float)(i8)b[2 + (d & 31)];
}

// Values d and d + 1 (0 when !pair) of head g in cell `cell`: one 4-byte load from an f16 cache.
__device__ __forceinline__ void kv_load_pair(const u8* base, const u32* pg, long long row_bytes, int head_bytes,
                                             int ty, int cell, int g, int d, bool pair, float* v0, float* v1) {
    if (ty == 0 && pair) {
        u32 h = *(const u32*)(base + kv_cell(pg, cell) * row_bytes + (long long)g * head_bytes + 2 * d);
        *v0 = h2f((u16)(h & 0xFFFF)), *v1 = h2f((u16)(h >> 16));
    } else {
        *v0 = kv_load(base, pg, row_bytes, head_bytes, ty, cell, g, d);
        *v1 = pair ? kv_load(base, pg, row_bytes, head_bytes, ty, cell, g, d + 1) : 0.f;
    }
}

// scores[(t * n_head + h) * n_keys + (j - lo)] for lo <= j < lo + n_keys; -inf outside the query's window.
// Grid (n_tok * n_head, ceil(n_keys / 8)), block 256: one warp per key, lanes over the head's dims.
extern "C" __global__ void attn_scores(const float* __restrict__ q, const u8* __restrict__ k,
                                       const u32* __restrict__ pg, float* __restrict__ scores, const unsigned int* __restrict__ pos,
                                       int n_head, int n_head_kv, int dk, int lo, int n_keys, float scale,
                                       int window, long long row_bytes, int head_bytes, int ty) {
    pdl_enter();
    int key = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (key >= n_keys) return;
    int th = blockIdx.x, t = th / n_head, h = th % n_head;
    int g = h / (n_head / n_head_kv);
    int p = (int)pos[t], j = lo + key;
    int first = window > 0 ? max(0, p + 1 - window) : 0;
    float* out = scores + (long long)th * n_keys + key;
    if (j < first || j > p) {
        if (lane == 0) *out = -STRATA_INF;
        return;
    }
    const float* qv = q + (long long)th * dk;
    float acc = 0.f;
    for (int d = lane; d < dk; d += 32) {
        float a = qv[d];
        if (ty == 0) a = round_f16(a);
        acc += a * kv_load(k, pg, row_bytes, head_bytes, ty, j, g, d);
    }
    acc = warp_sum(acc);
    if (lane == 0) *out = scale * acc;
}

// Softmax of each row of n_keys scores in place (cpu: softmax_row), then rounded to f16 when round != 0.
// One block of 256 per row.
extern "C" __global__ void attn_softmax(float* __restrict__ scores, int n_keys, int round) {
    pdl_enter();
    __shared__ float smax[8];
    __shared__ double ssum[8];
    float* row = scores + (long long)blockIdx.x * n_keys;
    float m = -STRATA_INF;
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) m = fmaxf(m, row[i]);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) smax[threadIdx.x >> 5] = m;
    __syncthreads();
    m = smax[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, smax[w]);
    double s = 0.0;
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) {
        float e = expf(row[i] - m);
        row[i] = e;
        s += (double)e;
    }
    s = warp_sum_d(s);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) ssum[threadIdx.x >> 5] = s;
    __syncthreads();
    double tot = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) tot += ssum[w];
    float inv = (float)(1.0 / tot);
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) {
        float p = row[i] * inv;
        row[i] = round ? round_f16(p) : p;
    }
}

// part[split][th][d] = sum over this split's keys of P[th][j] * V[j][g][d]. Grid (n_tok * n_head, n_split),
// block min(dv, 256) threads looping over dims.
extern "C" __global__ void attn_pv(const float* __restrict__ probs, const u8* __restrict__ v,
                                   const u32* __restrict__ pg, float* __restrict__ part, int n_rows, int n_head, int n_head_kv, int dv,
                                   int lo, int n_keys, int split_len, long long row_bytes, int head_bytes, int ty) {
    pdl_enter();
    int th = blockIdx.x, split = blockIdx.y;
    int h = th % n_head, g = h / (n_head / n_head_kv);
    int k0 = split * split_len, k1 = min(n_keys, k0 + split_len);
    const float* pr = probs + (long long)th * n_keys;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float acc = 0.f;
        for (int key = k0; key < k1; ++key) {
            float w = pr[key];
            if (w != 0.f) acc += w * kv_load(v, pg, row_bytes, head_bytes, ty, lo + key, g, d);
        }
        part[((long long)split * n_rows + th) * dv + d] = acc;
    }
}

// out[i] = sum over splits of part[s][i], n values per split.
extern "C" __global__ void sum_splits(const float* __restrict__ part, float* __restrict__ out, int n_split,
                                      long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.f;
    for (int k = 0; k < n_split; ++k) s += part[(long long)k * n + i];
    out[i] = s;
}

#define ATTN_KEYS_IN_FLIGHT 4
// The scores of keys j0..j1 (cells first + j) against the query staged in shared memory (qs: rounded to f16
// against an f16 cache), scale * q.k into sc[j], by the whole block: eight lanes per key, lane l taking the row's
// 16-byte chunks (eight f16 dims) l, l + 8, ..., so a warp reads four rows of 128 bytes per load, and
// ATTN_KEYS_IN_FLIGHT keys per lane group in flight (a span of 128 keys is one round of loads); the eight partial sums
// meet in three shuffles. A Q8_0 (or unaligned) row goes value by
// value over the same lanes. Returns the thread's largest score (-inf if none). Every thread of the block calls
// it (warp-uniform loops: the shuffles need every lane).
__device__ __forceinline__ float attn_scores_block(const float* __restrict__ qs, const u8* __restrict__ k,
                                                   const u32* __restrict__ pg, long long krb, int khb, int kty, int first, int g, int dk,
                                                   float scale, int j0, int j1, float* sc) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane >> 3, l8 = lane & 7;
    int step = (blockDim.x >> 5) * 4;
    bool vec = kty == 0 && (dk & 7) == 0 && ((krb | khb) & 15) == 0;
    float m = -STRATA_INF;
    for (int base = j0 + warp * 4; base < j1; base += ATTN_KEYS_IN_FLIGHT * step) {
        float acc[ATTN_KEYS_IN_FLIGHT];
        int js[ATTN_KEYS_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < ATTN_KEYS_IN_FLIGHT; ++u) acc[u] = 0.f, js[u] = base + u * step + sub;
        if (vec) {
            uint4 w[ATTN_KEYS_IN_FLIGHT][4];
#pragma unroll
            for (int u = 0; u < ATTN_KEYS_IN_FLIGHT; ++u) {
                const uint4* r4 =
                    (const uint4*)(k + kv_cell(pg, js[u] < j1 ? first + js[u] : first + j0) * krb + (long long)g * khb);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int c = l8 + 8 * i;
                    if (js[u] < j1 && c < dk / 8) w[u][i] = r4[c];
                }
            }
#pragma unroll
            for (int u = 0; u < ATTN_KEYS_IN_FLIGHT; ++u)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int c = l8 + 8 * i;
                    if (js[u] < j1 && c < dk / 8) {
                        const float* qq = qs + 8 * c;
                        u32 h[4] = {w[u][i].x, w[u][i].y, w[u][i].z, w[u][i].w};
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            acc[u] += qq[2 * e] * h2f((u16)(h[e] & 0xFFFF)) + qq[2 * e + 1] * h2f((u16)(h[e] >> 16));
                    }
                }
            for (int c = l8 + 32; c < dk / 8; c += 8) // heads over 256 dims
#pragma unroll
                for (int u = 0; u < ATTN_KEYS_IN_FLIGHT; ++u)
                    if (js[u] < j1) {
                        uint4 x = ((const uint4*)(k + kv_cell(pg, first + js[u]) * krb + (long long)g * khb))[c];
                        u32 h[4] = {x.x, x.y, x.z, x.w};
                        for (int e = 0; e < 4; ++e)
                            acc[u] += qs[8 * c + 2 * e] * h2f((u16)(h[e] & 0xFFFF)) +
                                      qs[8 * c + 2 * e + 1] * h2f((u16)(h[e] >> 16));
                    }
        } else {
#pragma unroll
            for (int u = 0; u < ATTN_KEYS_IN_FLIGHT; ++u)
                if (js[u] < j1)
                    for (int d = l8; d < dk; d += 8) acc[u] += qs[d] * kv_load(k, pg, krb, khb, kty, first + js[u], g, d);
        }
#pragma unroll
        for (int u = 0; u < ATTN_KEYS_IN_FLIGHT; ++u) {
            float a = acc[u];
            a += __shfl_xor_sync(0xffffffffu, a, 1);
            a += __shfl_xor_sync(0xffffffffu, a, 2);
            a += __shfl_xor_sync(0xffffffffu, a, 4);
            if (js[u] < j1) {
                float v = scale * a;
                if (l8 == 0) sc[js[u]] = v;
                m = fmaxf(m, v);
            }
        }
    }
    return m;
}

// P.V over keys j0..j1 (relative to cell `first`) for one block: probabilities p = sc[j] * inv, rounded to f16 when
// `round` (an f16 cache: the CPU rounds them so), times the values of head g. The block's threads split into groups
// of dv / 2 (rounded up to warps), each thread two dims, each group taking every groups-th key, eight keys in
// flight; the groups' sums meet in pv (shared, dv floats). Dims d_off..d_off + dv of the head (dv / 2 at most the
// block's threads). Every thread of the block calls it (it synchronises).
__device__ __forceinline__ void attn_pv_block(const float* sc, float inv, bool round, const u8* __restrict__ v,
                                              const u32* __restrict__ pg, long long vrb, int vhb, int vty, int first, int g, int j0, int j1,
                                              int d_off, int dv, float* pv) {
    int per = ((dv + 1) / 2 + 31) & ~31;
    int groups = max(1, (int)blockDim.x / per);
    int grp = threadIdx.x / per, d = 2 * (threadIdx.x % per);
    float acc0 = 0.f, acc1 = 0.f;
    if (grp < groups && d < dv) {
        float a0[8], a1[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) a0[u] = a1[u] = 0.f;
        bool pair = d + 1 < dv;
        int j = j0 + grp;
        for (; j + 7 * groups < j1; j += 8 * groups) {
            float pr[8], v0[8], v1[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                int cell = first + j + u * groups;
                pr[u] = sc[j + u * groups];
                kv_load_pair(v, pg, vrb, vhb, vty, cell, g, d_off + d, pair, &v0[u], &v1[u]);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                float p = pr[u] * inv;
                if (round) p = round_f16(p);
                a0[u] += p * v0[u];
                a1[u] += p * v1[u];
            }
        }
        for (; j < j1; j += groups) {
            float p = sc[j] * inv;
            if (round) p = round_f16(p);
            a0[0] += p * kv_load(v, pg, vrb, vhb, vty, first + j, g, d_off + d);
            if (pair) a1[0] += p * kv_load(v, pg, vrb, vhb, vty, first + j, g, d_off + d + 1);
        }
        acc0 = ((a0[0] + a0[1]) + (a0[2] + a0[3])) + ((a0[4] + a0[5]) + (a0[6] + a0[7]));
        acc1 = ((a1[0] + a1[1]) + (a1[2] + a1[3])) + ((a1[4] + a1[5]) + (a1[6] + a1[7]));
    }
    for (int gi = 0; gi < groups; ++gi) {
        if (grp == gi && d < dv) {
            if (gi == 0) pv[d] = acc0; else pv[d] += acc0;
            if (d + 1 < dv) {
                if (gi == 0) pv[d + 1] = acc1; else pv[d + 1] += acc1;
            }
        }
        __syncthreads();
    }
}

// attn_pv_block for an f16 cache whose head rows are 16-byte aligned (dv a multiple of 8, dv / 8 at most the
// block's threads): each thread takes eight dims (one 16-byte load per key), the block's threads split into groups
// of dv / 8, each group taking every groups-th key with eight keys in flight, so a span of 128 keys (dv 128, 256
// threads) is one round of loads; the groups' sums meet in shared memory (groups * dv <= 8 * blockDim.x floats).
__device__ __forceinline__ void attn_pv_block_f16(const float* sc, float inv, const u8* __restrict__ v,
                                                  const u32* __restrict__ pg, long long vrb, int vhb, int first,
                                                  int g, int j0, int j1, int dv, float* pv) {
    __shared__ float part[2048];
    int per = dv / 8, groups = (int)blockDim.x / per;
    int grp = threadIdx.x / per, d = 8 * (threadIdx.x % per);
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    if (grp < groups) {
        const u8* base = v + (long long)g * vhb + 2 * d;
        for (int j = j0 + grp; j < j1; j += 8 * groups) {
            uint4 w[8];
            float pr[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                int jj = j + u * groups;
                if (jj < j1) {
                    w[u] = *(const uint4*)(base + kv_cell(pg, first + jj) * vrb);
                    pr[u] = round_f16(sc[jj] * inv);
                } else {
                    w[u] = make_uint4(0, 0, 0, 0);
                    pr[u] = 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                u32 h[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[2 * e] += pr[u] * h2f((u16)(h[e] & 0xFFFF));
                    acc[2 * e + 1] += pr[u] * h2f((u16)(h[e] >> 16));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) part[grp * dv + d + i] = acc[i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < dv; i += blockDim.x) {
        float s = 0.f;
        for (int gi = 0; gi < groups; ++gi) s += part[gi * dv + i];
        pv[i] = s;
    }
    __syncthreads();
}

// Decode attention in one launch (cpu: Backend::attention, the same rounding): block (h, t) computes query head h
// of token t against cells first..=pos[t] (first = pos + 1 - window with a window), reading its position from the
// device, so the launch's arguments do not change from one decode step to the next (CUDA graphs). Scores by
// attn_scores_block, kept in shared memory up to ATTN_DEC_KEYS keys (else in scores[(t * n_head + h) * n_ctx
// ...]); out is [n_tok][n_head][dv]. dk at most ATTN_DK_MAX, dv at most 256. Block 256 threads (8 warps).
//
// With kraw given (one token, f16 caches, dk and dv multiples of 8 with 16-byte aligned rows): q, kraw and vraw are
// the layer's raw q/k/v rows, and the block first does what qk_norm_rope does with its store, for its own heads:
// head_norm_rope of query head h and of key head g (qw, kw: the norms' weights, or null), the key and value rounded
// to f16 as the cache holds them; the block of the group's first query head writes them into cell pos (through kc and
// vc, the same buffers as k and v: no block reads cell pos from them, so the loads through the restrict pointers
// never meet the stores). The cell's score and P.V term come from those shared copies.
//
// k and v (and kc and vc) are the layer's pool arrays, pg the sequence's page table (kv_cell). With kvtab given (a
// step of several sequences' decode tokens, continuous batching): token t's cache is its page table kvtab[3t] and
// the arrays kvtab[3t + 1] and kvtab[3t + 2] (keys, values) in place of pg, k and v (and kc and vc), and with kraw
// its raw rows are row t of kraw and vraw; the caches share their geometry (krb, khb, vrb, vhb, n_ctx).
#define ATTN_DEC_KEYS 1024
#define ATTN_DK_MAX 512
extern "C" __global__ void attn_decode(const float* __restrict__ q, const u8* __restrict__ k,
                                       const u8* __restrict__ v, const u32* __restrict__ pg,
                                       float* __restrict__ scores,
                                       float* __restrict__ out, const unsigned int* __restrict__ pos, int n_head,
                                       int n_head_kv, int dk, int dv, float scale, int window, long long krb,
                                       int khb, int kty, long long vrb, int vhb, int vty, int n_ctx,
                                       const float* __restrict__ kraw, const float* __restrict__ vraw,
                                       const float* __restrict__ qw, const float* __restrict__ kw, float eps,
                                       int n_rot, float theta_scale, float freq_scale, int neox, u16* kc, u16* vc,
                                       const unsigned long long* __restrict__ kvtab) {
    pdl_enter();
    __shared__ float red[8];
    __shared__ double redd[8];
    __shared__ float pv[256];
    __shared__ float qs[ATTN_DK_MAX];
    __shared__ float ks[ATTN_DK_MAX];
    __shared__ float vs[256];
    __shared__ float scs[ATTN_DEC_KEYS];
    __shared__ u32 pgs[ATTN_DEC_KEYS / KV_BLOCK_CELLS + 1];
    int h = blockIdx.x, t = blockIdx.y, th = t * n_head + h;
    if (kvtab) {
        // A step of several sequences: token t attends over (and, fused, stores into) its own sequence's cache.
        pg = (const u32*)kvtab[3 * t];
        k = (const u8*)kvtab[3 * t + 1];
        v = (const u8*)kvtab[3 * t + 2];
        kc = (u16*)kvtab[3 * t + 1];
        vc = (u16*)kvtab[3 * t + 2];
    }
    int group = n_head / n_head_kv, g = h / group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = (int)pos[t];
    int first = window > 0 ? max(0, p + 1 - window) : 0;
    int n = p + 1 - first;
    float* sc = n <= ATTN_DEC_KEYS ? scs : scores + (long long)th * n_ctx;
    const float* qv = q + (long long)th * dk;
    if (n <= ATTN_DEC_KEYS) {
        // The span's page-table entries in shared memory (read after the __syncthreads below), so the key and
        // value loops wait on no global read of the table ahead of each row.
        int b0 = first / KV_BLOCK_CELLS, nb = p / KV_BLOCK_CELLS - b0 + 1;
        for (int i = threadIdx.x; i < nb; i += blockDim.x) pgs[i] = pg[b0 + i];
        pg = pgs - b0;
    }
    // Keys from the cache: all n, or (fused) the n - 1 before the token's own.
    int n_cached = n;
    if (kraw) {
        n_cached = n - 1;
        for (int d = threadIdx.x; d < dk; d += blockDim.x)
            qs[d] = qv[d], ks[d] = kraw[((long long)t * n_head_kv + g) * dk + d];
        __syncthreads();
        if (warp == 0) head_norm_rope(qs, qw, dk, eps, p, n_rot, theta_scale, freq_scale, neox);
        if (warp == 1) head_norm_rope(ks, kw, dk, eps, p, n_rot, theta_scale, freq_scale, neox);
        __syncthreads();
        bool writer = h % group == 0;
        long long row = kv_cell(pg, p);
        u16* kdst = (u16*)((u8*)kc + row * krb + (long long)g * khb);
        u16* vdst = (u16*)((u8*)vc + row * vrb + (long long)g * vhb);
        for (int d = threadIdx.x; d < dk; d += blockDim.x) {
            u16 kh = f2h(ks[d]);
            if (writer) kdst[d] = kh;
            ks[d] = h2f(kh);
            qs[d] = round_f16(qs[d]);
        }
        for (int d = threadIdx.x; d < dv; d += blockDim.x) {
            u16 vh = f2h(vraw[((long long)t * n_head_kv + g) * dv + d]);
            if (writer) vdst[d] = vh;
            vs[d] = h2f(vh);
        }
    } else {
        for (int d = threadIdx.x; d < dk; d += blockDim.x) qs[d] = kty == 0 ? round_f16(qv[d]) : qv[d];
    }
    __syncthreads();
    float m = attn_scores_block(qs, k, pg, krb, khb, kty, first, g, dk, scale, 0, n_cached, sc);
    if (kraw && warp == 0) {
        float a = 0.f;
        for (int d = lane; d < dk; d += 32) a += qs[d] * ks[d];
        a = scale * warp_sum(a);
        if (lane == 0) sc[n - 1] = a;
        m = fmaxf(m, a);
    }
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < 8; ++w) m = fmaxf(m, red[w]);
    double s = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = expf(sc[j] - m);
        sc[j] = e;
        s += (double)e;
    }
    s = warp_sum_d(s);
    if (lane == 0) redd[warp] = s;
    __syncthreads();
    double tot = 0.0;
    for (int w = 0; w < 8; ++w) tot += redd[w];
    float inv = (float)(1.0 / tot);
    if (vty == 0 && (dv & 7) == 0 && dv / 8 <= (int)blockDim.x && ((vrb | vhb) & 15) == 0)
        attn_pv_block_f16(sc, inv, v, pg, vrb, vhb, first, g, 0, n_cached, dv, pv);
    else
        attn_pv_block(sc, inv, vty == 0, v, pg, vrb, vhb, vty, first, g, 0, n_cached, 0, dv, pv);
    float* o = out + (long long)th * dv;
    if (threadIdx.x < dv) o[threadIdx.x] = kraw ? pv[threadIdx.x] + round_f16(sc[n - 1] * inv) * vs[threadIdx.x]
                                                : pv[threadIdx.x];
}

// Prefill attention over an f16 cache on the tensor cores, flash-style (tiles of keys through shared memory, no
// n_tok x n_keys score matrix), with the CPU's rounding: queries rounded to f16 (as the CPU does against an f16
// cache), scores in f32 from f16 x f16 products (mma.m16n8k16, f32 accumulation), an exact softmax in two passes
// over the keys (pass 1: row max and sum, the sum in f64; pass 2: p = exp(s - max) * (1 / sum) rounded to f16, as
// the CPU rounds its probabilities against an f16 cache), then P.V on the tensor cores with f32 accumulation.
//
// A block serves one KV head and 16 * tgroups consecutive tokens for every query head of its GQA group, so each
// key and value tile is read once for all of them: warp w takes head (kv head * group + w % group) and tokens
// 16 (w / group).. of the block. Block 32 * group * tgroups threads (at most 256); grid
// (ceil(n_tok / (16 * tgroups)), n_head_kv). dk and dv are multiples of 16, at most 128. Keys in tiles of 64.
//
// kty / vty 1: a Q8_0 (int8) cache, whose rows are dequantized into the f16 tiles (d * q rounded to f16; dk or dv
// then a multiple of 32). Not the CPU's rounding there (it takes the queries and the probabilities in f32 against
// an int8 cache): the switch STRATA_INT8_FLASH, judged by KL divergence.
#define FA_KEYS 64
#define FA_DMAX 128

// Rows kt.. kt + FA_KEYS - 1 of head g (0 past hi) into the f16 tile t (row stride ks halves): 16-byte copies from
// an f16 cache, or Q8_0 blocks dequantized (one block of 32 values per thread and step).
__device__ __forceinline__ void fa_tile(u16* t, int ks, const u8* src, const u32* __restrict__ pg, long long rb,
                                        int hb, int ty, int g, int kt, int hi, int d) {
    if (ty == 0) {
        // Unrolled so a thread's page-table reads (one per key row) are in flight together, not each ahead of
        // its row's load.
#pragma unroll 4
        for (int i = threadIdx.x; i < FA_KEYS * d / 8; i += blockDim.x) {
            int key = i / (d / 8), c = i % (d / 8), j = kt + key;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (j <= hi) val = *(const uint4*)(src + kv_cell(pg, j) * rb + (long long)g * hb + 16 * c);
            *(uint4*)(t + key * ks + 8 * c) = val;
        }
        return;
    }
#pragma unroll 2
    for (int i = threadIdx.x; i < FA_KEYS * d / 32; i += blockDim.x) {
        int key = i / (d / 32), b = i % (d / 32), j = kt + key;
        uint4* dst = (uint4*)(t + key * ks + 32 * b);
        if (j > hi) {
            for (int c = 0; c < 4; ++c) dst[c] = make_uint4(0, 0, 0, 0);
            continue;
        }
        const u8* blk = src + kv_cell(pg, j) * rb + (long long)g * hb + 34 * b;
        float scale = h2f(ld16(blk));
        const u16* qs = (const u16*)(blk + 2); // 2-byte aligned: blocks are 34 bytes, rows and heads even
        for (int c = 0; c < 4; ++c) {
            u32 w[4];
            for (int e = 0; e < 4; ++e) {
                u16 two = qs[4 * c + e]; // values 8c + 2e and 8c + 2e + 1 (little-endian)
                w[e] = pack_h2(f2h(scale * (float)(i8)(two & 0xFF)), f2h(scale * (float)(i8)(two >> 8)));
            }
            dst[c] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) attn_prefill_f16(
    const float* __restrict__ q, const u8* __restrict__ k, const u8* __restrict__ v, const u32* __restrict__ pg,
    float* __restrict__ out, const unsigned int* __restrict__ pos, int n_tok, int n_head, int n_head_kv, int dk, int dv, float scale,
    int window, long long krb, int khb, long long vrb, int vhb, int tgroups, int kty, int vty) {
    pdl_enter();
    const int KS = FA_DMAX + 8; // padded row strides (halves) of the key and value tiles
    __shared__ __align__(16) u16 ks[FA_KEYS * KS];
    __shared__ __align__(16) u16 vs[FA_KEYS * KS];
    __shared__ int lo_hi[2];
    int group = n_head / n_head_kv, g = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
    int h = g * group + warp % group;
    // The last tokens (the most keys) first: the longest blocks start in the first wave, the short ones fill in.
    int t0 = (gridDim.x - 1 - blockIdx.x) * 16 * tgroups + 16 * (warp / group);
    int rows[2] = {t0 + gid, t0 + gid + 8};
    int last[2], first[2];
    for (int i = 0; i < 2; ++i) {
        last[i] = rows[i] < n_tok ? (int)pos[rows[i]] : -1;
        first[i] = window > 0 ? max(0, last[i] + 1 - window) : 0;
    }
    // The warp's own key range (a tile outside it is skipped by this warp) and the block's.
    int wlo = last[0] >= 0 ? first[0] : 0x7fffffff, whi = max(last[0], last[1]);
    if (last[1] >= 0) wlo = min(wlo, first[1]);
    for (int off = 16; off > 0; off >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, off));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, off));
    }
    if (threadIdx.x == 0) lo_hi[0] = 0x7fffffff, lo_hi[1] = -1;
    __syncthreads();
    if (lane == 0 && whi >= 0) atomicMin(&lo_hi[0], wlo), atomicMax(&lo_hi[1], whi);
    __syncthreads();
    int lo = lo_hi[0], hi = lo_hi[1];
    if (hi < 0) return;

    // This warp's 16 query rows as A fragments, rounded to f16.
    u32 qa[FA_DMAX / 16][4];
#pragma unroll
    for (int kk = 0; kk < FA_DMAX / 16; ++kk) {
        if (kk * 16 >= dk) break;
        for (int r = 0; r < 4; ++r) {
            int row = rows[r & 1], col = kk * 16 + t4 * 2 + (r >> 1) * 8;
            const float* qr = q + ((long long)row * n_head + h) * dk;
            qa[kk][r] = row < n_tok ? pack_h2(f2h(qr[col]), f2h(qr[col + 1])) : 0u;
        }
    }
    float m[2] = {-STRATA_INF, -STRATA_INF};
    double l[2] = {0.0, 0.0};
    float o[FA_DMAX / 8][4];
#pragma unroll
    for (int nb = 0; nb < FA_DMAX / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
    float inv[2] = {0.f, 0.f};

    for (int pass = 0; pass < 2; ++pass) {
        for (int kt = lo; kt <= hi; kt += FA_KEYS) {
            __syncthreads();
            fa_tile(ks, KS, k, pg, krb, khb, kty, g, kt, hi, dk);
            if (pass == 1) fa_tile(vs, KS, v, pg, vrb, vhb, vty, g, kt, hi, dv);
            __syncthreads();
            if (kt > whi || kt + FA_KEYS <= wlo) continue; // every row of this warp masks the whole tile
            // S = Q K^T for this warp's 16 rows and the tile's 64 keys: 8 blocks of 8 keys.
            float s[FA_KEYS / 8][4];
#pragma unroll
            for (int nb = 0; nb < FA_KEYS / 8; ++nb) {
                s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < FA_DMAX / 16; ++kk) {
                    if (kk * 16 >= dk) break;
                    const u16* kr = ks + (nb * 8 + gid) * KS + kk * 16 + t4 * 2;
                    mma_16816(s[nb], qa[kk], *(const u32*)kr, *(const u32*)(kr + 8));
                }
            }
            // Scale and mask: element e of block nb is row rows[e >> 1], key kt + nb * 8 + t4 * 2 + (e & 1).
#pragma unroll
            for (int nb = 0; nb < FA_KEYS / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int r = e >> 1, j = kt + nb * 8 + t4 * 2 + (e & 1);
                    bool ok = j >= first[r] && j <= last[r];
                    s[nb][e] = ok ? scale * s[nb][e] : -STRATA_INF;
                }
            if (pass == 0) {
                for (int r = 0; r < 2; ++r) {
                    float tm = -STRATA_INF;
#pragma unroll
                    for (int nb = 0; nb < FA_KEYS / 8; ++nb) tm = fmaxf(tm, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
                    float nm = fmaxf(m[r], tm);
                    if (nm == -STRATA_INF) continue;
                    double acc = m[r] == -STRATA_INF ? 0.0 : l[r] * exp((double)m[r] - (double)nm);
#pragma unroll
                    for (int nb = 0; nb < FA_KEYS / 8; ++nb)
                        for (int e = 0; e < 2; ++e) acc += (double)expf(s[nb][2 * r + e] - nm);
                    l[r] = acc;
                    m[r] = nm;
                }
            } else {
                // P (f16, rounded as the CPU rounds) as A fragments over the tile's 16-key steps.
#pragma unroll
                for (int kk = 0; kk < FA_KEYS / 16; ++kk) {
                    u32 pa[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        // a0: row 0, block 2kk; a1: row 1, block 2kk; a2: row 0, block 2kk+1; a3: row 1, block 2kk+1.
                        int nb = 2 * kk + (r >> 1), rr = r & 1;
                        float p0 = s[nb][2 * rr] == -STRATA_INF ? 0.f : expf(s[nb][2 * rr] - m[rr]) * inv[rr];
                        float p1 = s[nb][2 * rr + 1] == -STRATA_INF ? 0.f : expf(s[nb][2 * rr + 1] - m[rr]) * inv[rr];
                        pa[r] = pack_h2(f2h(p0), f2h(p1));
                    }
#pragma unroll
                    for (int nb = 0; nb < FA_DMAX / 8; ++nb) {
                        if (nb * 8 >= dv) break;
                        int key = kk * 16 + t4 * 2, col = nb * 8 + gid;
                        u32 b0 = pack_h2(vs[key * KS + col], vs[(key + 1) * KS + col]);
                        u32 b1 = pack_h2(vs[(key + 8) * KS + col], vs[(key + 9) * KS + col]);
                        mma_16816(o[nb], pa, b0, b1);
                    }
                }
            }
        }
        if (pass == 0) {
            // Combine the row statistics of the four threads that share each row.
            for (int r = 0; r < 2; ++r) {
                float mm = m[r];
                for (int off = 1; off < 4; off <<= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, off));
                double part = m[r] == -STRATA_INF ? 0.0 : l[r] * exp((double)m[r] - (double)mm);
                for (int off = 1; off < 4; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
                m[r] = mm;
                l[r] = part;
                inv[r] = part > 0.0 ? (float)(1.0 / part) : 0.f;
            }
        }
    }
#pragma unroll
    for (int nb = 0; nb < FA_DMAX / 8; ++nb) {
        if (nb * 8 >= dv) break;
        for (int e = 0; e < 4; ++e) {
            int row = rows[e >> 1];
            if (row < n_tok) out[((long long)row * n_head + h) * dv + nb * 8 + t4 * 2 + (e & 1)] = o[nb][e];
        }
    }
}

// Decode attention split over the keys (flash-decoding), for long caches: the same rounding as attn_decode in four
// steps over n_split splits of split_len cells (relative to the query's first visible cell), every launch with
// arguments that do not depend on the position (CUDA graphs). Steps 1 and 3 serve a KV head's whole GQA group in one
// block (grid (n_head_kv, n_tok, n_split)), so each key and value row is read once for all the group's query heads:
// heads in chunks of ATTN_GQA_CHUNK (fewer when 16 * dk would not fit the staged queries). Step 2 runs per query
// head (grid (n_head, n_tok, n_split)). The splits' maxima and sums are reduced by the whole block. With kvtab given
// (a step of several sequences' decode tokens, as attn_decode's), token t reads its own sequence's cache: page table
// kvtab[3t], key array kvtab[3t + 1] and value array kvtab[3t + 2] in place of pg, k and v; a token whose span is
// shorter than the launch's splits cover leaves its later splits empty (maximum -inf, sum 0, P.V 0).
#define ATTN_GQA_CHUNK 16
#define ATTN_GQA_QS 4096
__device__ __forceinline__ int attn_gqa_chunk(int dk) { return min(ATTN_GQA_CHUNK, ATTN_GQA_QS / dk); }

// Step 1, block 256: scores of the split into scores[th * n_ctx + j] and the split's maximum into
// pmax[th * n_split + s] for every query head th of the group; eight lanes per key as attn_scores_block.
extern "C" __global__ void __launch_bounds__(256)
    attn_split_scores(const float* __restrict__ q, const u8* __restrict__ k, const u32* __restrict__ pg,
                      float* __restrict__ scores,
                      float* __restrict__ pmax, const unsigned int* __restrict__ pos, int n_head, int n_head_kv,
                      int dk, float scale, int window, long long krb, int khb, int kty, int n_ctx, int split_len,
                      const unsigned long long* __restrict__ kvtab) {
    pdl_enter();
    __shared__ float qs[ATTN_GQA_QS];
    __shared__ float red[8][ATTN_GQA_CHUNK];
    int g = blockIdx.x, t = blockIdx.y, s = blockIdx.z, n_split = gridDim.z;
    if (kvtab) pg = (const u32*)kvtab[3 * t], k = (const u8*)kvtab[3 * t + 1];
    int gs = n_head / n_head_kv, hpc = attn_gqa_chunk(dk);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane >> 3, l8 = lane & 7;
    int p = (int)pos[t], first = window > 0 ? max(0, p + 1 - window) : 0, n = p + 1 - first;
    int j0 = s * split_len, j1 = min(n, j0 + split_len);
    int step = (blockDim.x >> 5) * 4;
    bool vec = kty == 0 && (dk & 7) == 0 && ((krb | khb) & 15) == 0;
    for (int hb = 0; hb < gs; hb += hpc) {
        int nh = min(hpc, gs - hb), th0 = t * n_head + g * gs + hb;
        __syncthreads();
        for (int i = threadIdx.x; i < nh * dk; i += blockDim.x) {
            float x = q[(long long)th0 * dk + i];
            qs[i] = kty == 0 ? round_f16(x) : x;
        }
        __syncthreads();
        float m[ATTN_GQA_CHUNK];
#pragma unroll
        for (int i = 0; i < ATTN_GQA_CHUNK; ++i) m[i] = -STRATA_INF;
        for (int base = j0 + warp * 4; base < j1; base += step) {
            int j = base + sub;
            bool ok = j < j1;
            float acc[ATTN_GQA_CHUNK];
#pragma unroll
            for (int i = 0; i < ATTN_GQA_CHUNK; ++i) acc[i] = 0.f;
            const u8* row = k + kv_cell(pg, first + (ok ? j : j0)) * krb + (long long)g * khb;
            if (vec) {
                for (int c = l8; c < dk / 8; c += 8) {
                    uint4 w = ((const uint4*)row)[c];
                    float kf[8];
                    u32 hw[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) kf[2 * e] = h2f((u16)(hw[e] & 0xFFFF)), kf[2 * e + 1] = h2f((u16)(hw[e] >> 16));
#pragma unroll
                    for (int i = 0; i < ATTN_GQA_CHUNK; ++i)
                        if (i < nh) {
                            const float* qq = qs + i * dk + 8 * c;
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[i] += qq[e] * kf[e];
                        }
                }
            } else {
                for (int d = l8; d < dk; d += 8) {
                    float kv = kv_load(k, pg, krb, khb, kty, first + (ok ? j : j0), g, d);
#pragma unroll
                    for (int i = 0; i < ATTN_GQA_CHUNK; ++i)
                        if (i < nh) acc[i] += qs[i * dk + d] * kv;
                }
            }
#pragma unroll
            for (int i = 0; i < ATTN_GQA_CHUNK; ++i) {
                if (i >= nh) break;
                float a = acc[i];
                a += __shfl_xor_sync(0xffffffffu, a, 1);
                a += __shfl_xor_sync(0xffffffffu, a, 2);
                a += __shfl_xor_sync(0xffffffffu, a, 4);
                if (ok) {
                    float v = scale * a;
                    if (l8 == 0) scores[(long long)(th0 + i) * n_ctx + j] = v;
                    m[i] = fmaxf(m[i], v);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < ATTN_GQA_CHUNK; ++i) {
            if (i >= nh) break;
            float v = warp_max(m[i]);
            if (lane == 0) red[warp][i] = v;
        }
        __syncthreads();
        if (threadIdx.x < nh) {
            float v = red[0][threadIdx.x];
            for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = fmaxf(v, red[w][threadIdx.x]);
            pmax[(long long)(th0 + threadIdx.x) * n_split + s] = v;
        }
    }
}

// Step 2, block 128: the maximum over splits, the split's exponentials in place and their f64 sum into
// psum[th * n_split + s].
extern "C" __global__ void __launch_bounds__(128)
    attn_split_exp(float* __restrict__ scores, const float* __restrict__ pmax, double* __restrict__ psum,
                   const unsigned int* __restrict__ pos, int n_head, int window, int n_ctx, int split_len) {
    pdl_enter();
    __shared__ double red[4];
    __shared__ float redm[4];
    int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z, n_split = gridDim.z, th = t * n_head + h;
    int p = (int)pos[t], first = window > 0 ? max(0, p + 1 - window) : 0, n = p + 1 - first;
    int j0 = s * split_len, j1 = min(n, j0 + split_len);
    float m = -STRATA_INF;
    for (int i = threadIdx.x; i < n_split; i += blockDim.x) m = fmaxf(m, pmax[(long long)th * n_split + i]);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) redm[threadIdx.x >> 5] = m;
    __syncthreads();
    m = fmaxf(fmaxf(redm[0], redm[1]), fmaxf(redm[2], redm[3]));
    float* sc = scores + (long long)th * n_ctx;
    double acc = 0.0;
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        float e = expf(sc[j] - m);
        sc[j] = e;
        acc += (double)e;
    }
    acc = warp_sum_d(acc);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) psum[(long long)th * n_split + s] = (red[0] + red[1]) + (red[2] + red[3]);
}

// Step 3, block 256: for every query head th of the group, probabilities (exponential times 1 / the f64 sum over
// splits, rounded to f16 against an f16 cache) times the split's values into part[(s * rows + th) * dv + d];
// sum_splits adds the splits. Threads take two dims each (groups of dv / 2 rounded up to warps, each group every
// groups-th key), every value pair read once for the chunk's heads; dims in chunks of 256.
extern "C" __global__ void __launch_bounds__(256)
    attn_split_pv(const float* __restrict__ scores, const double* __restrict__ psum, const u8* __restrict__ v,
                  const u32* __restrict__ pg, float* __restrict__ part, const unsigned int* __restrict__ pos, int n_head, int n_head_kv, int dv,
                  int window, long long vrb, int vhb, int vty, int n_ctx, int split_len, int rows,
                  const unsigned long long* __restrict__ kvtab) {
    pdl_enter();
    __shared__ float inv[ATTN_GQA_CHUNK];
    __shared__ float pv[ATTN_GQA_CHUNK * 256];
    __shared__ float ps[ATTN_GQA_CHUNK * 64];
    int g = blockIdx.x, t = blockIdx.y, s = blockIdx.z, n_split = gridDim.z;
    if (kvtab) pg = (const u32*)kvtab[3 * t], v = (const u8*)kvtab[3 * t + 2];
    int gs = n_head / n_head_kv, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = (int)pos[t], first = window > 0 ? max(0, p + 1 - window) : 0, n = p + 1 - first;
    int j0 = s * split_len, j1 = min(n, j0 + split_len);
    bool round = vty == 0;
    for (int hb = 0; hb < gs; hb += ATTN_GQA_CHUNK) {
        int nh = min(ATTN_GQA_CHUNK, gs - hb), th0 = t * n_head + g * gs + hb;
        __syncthreads();
        for (int i = warp; i < nh; i += blockDim.x >> 5) {
            double tot = 0.0;
            for (int k2 = lane; k2 < n_split; k2 += 32) tot += psum[(long long)(th0 + i) * n_split + k2];
            tot = warp_sum_d(tot);
            if (lane == 0) inv[i] = (float)(1.0 / tot);
        }
        __syncthreads();
        for (int d0 = 0; d0 < dv; d0 += 256) {
            int w = min(256, dv - d0);
            int per = ((w + 1) / 2 + 31) & ~31, groups = max(1, (int)blockDim.x / per);
            int grp = threadIdx.x / per, d = 2 * (threadIdx.x % per);
            float a0[ATTN_GQA_CHUNK], a1[ATTN_GQA_CHUNK];
#pragma unroll
            for (int i = 0; i < ATTN_GQA_CHUNK; ++i) a0[i] = a1[i] = 0.f;
            bool mine = grp < groups && d < w, pair = d + 1 < w;
            // The probabilities of 64 keys at a time, for the chunk's heads, staged in shared memory.
            for (int c0 = j0; c0 < j1; c0 += 64) {
                int cn = min(64, j1 - c0);
                __syncthreads();
                for (int i = threadIdx.x; i < nh * 64; i += blockDim.x) {
                    int hh = i >> 6, jj = i & 63;
                    float pr = 0.f;
                    if (jj < cn) {
                        pr = scores[(long long)(th0 + hh) * n_ctx + c0 + jj] * inv[hh];
                        if (round) pr = round_f16(pr);
                    }
                    ps[i] = pr;
                }
                __syncthreads();
                if (!mine) continue;
                int jj = grp;
                for (; jj < cn; jj += 4 * groups) {
                    float v0[4], v1[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        int jk = jj + u * groups, cell = first + c0 + min(jk, cn - 1);
                        kv_load_pair(v, pg, vrb, vhb, vty, cell, g, d0 + d, pair, &v0[u], &v1[u]);
                        if (jk >= cn) v0[u] = v1[u] = 0.f;
                    }
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        int jk = min(jj + u * groups, 63);
#pragma unroll
                        for (int i = 0; i < ATTN_GQA_CHUNK; ++i)
                            if (i < nh) {
                                float pr = ps[i * 64 + jk];
                                a0[i] += pr * v0[u];
                                a1[i] += pr * v1[u];
                            }
                    }
                }
            }
            for (int gi = 0; gi < groups; ++gi) {
                if (grp == gi && mine)
#pragma unroll
                    for (int i = 0; i < ATTN_GQA_CHUNK; ++i)
                        if (i < nh) {
                            float* o = pv + i * 256 + d;
                            if (gi == 0) o[0] = a0[i]; else o[0] += a0[i];
                            if (pair) {
                                if (gi == 0) o[1] = a1[i]; else o[1] += a1[i];
                            }
                        }
                __syncthreads();
            }
            for (int i = threadIdx.x; i < nh * w; i += blockDim.x)
                part[((long long)s * rows + th0 + i / w) * dv + d0 + i % w] = pv[(i / w) * 256 + i % w];
            __syncthreads();
        }
    }
}
