// Causal GQA attention over the cache, in three passes that keep the CPU's rounding (cpu: Backend::attention):
// scores (q.k, with q rounded to f16 against an f16 cache), an exact softmax per row (sum in f64) whose
// probabilities are rounded to f16 against an f16 cache, then P.V split over the keys (split-K) and summed.
// Cache rows: cell j holds heads * head_bytes bytes; ty 0 = f16, 1 = Q8_0 (34-byte blocks of 32).

__device__ __forceinline__ float kv_load(const u8* base, long long row_bytes, int head_bytes, int ty, int cell,
                                         int head, int d) {
    const u8* h = base + (long long)cell * row_bytes + (long long)head * head_bytes;
    if (ty == 0) return h2f(((const u16*)h)[d]);
    const u8* b = h + 34 * (d >> 5);
    return h2f(ld16(b)) * (float)(i8)b[2 + (d & 31)];
}

// scores[(t * n_head + h) * n_keys + (j - lo)] for lo <= j < lo + n_keys; -inf outside the query's window.
// Grid (ceil(n_keys / 8), n_tok * n_head), block 256: one warp per key, lanes over the head's dims.
extern "C" __global__ void attn_scores(const float* __restrict__ q, const u8* __restrict__ k,
                                       float* __restrict__ scores, const unsigned int* __restrict__ pos,
                                       int n_head, int n_head_kv, int dk, int lo, int n_keys, float scale,
                                       int window, long long row_bytes, int head_bytes, int ty) {
    int key = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (key >= n_keys) return;
    int th = blockIdx.y, t = th / n_head, h = th % n_head;
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
        acc += a * kv_load(k, row_bytes, head_bytes, ty, j, g, d);
    }
    acc = warp_sum(acc);
    if (lane == 0) *out = scale * acc;
}

// Softmax of each row of n_keys scores in place (cpu: softmax_row), then rounded to f16 when round != 0.
// One block of 256 per row.
extern "C" __global__ void attn_softmax(float* __restrict__ scores, int n_keys, int round) {
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
                                   float* __restrict__ part, int n_rows, int n_head, int n_head_kv, int dv,
                                   int lo, int n_keys, int split_len, long long row_bytes, int head_bytes, int ty) {
    int th = blockIdx.x, split = blockIdx.y;
    int h = th % n_head, g = h / (n_head / n_head_kv);
    int k0 = split * split_len, k1 = min(n_keys, k0 + split_len);
    const float* pr = probs + (long long)th * n_keys;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float acc = 0.f;
        for (int key = k0; key < k1; ++key) {
            float w = pr[key];
            if (w != 0.f) acc += w * kv_load(v, row_bytes, head_bytes, ty, lo + key, g, d);
        }
        part[((long long)split * n_rows + th) * dv + d] = acc;
    }
}

// out[i] = sum over splits of part[s][i], n values per split.
extern "C" __global__ void sum_splits(const float* __restrict__ part, float* __restrict__ out, int n_split,
                                      long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.f;
    for (int k = 0; k < n_split; ++k) s += part[(long long)k * n + i];
    out[i] = s;
}

// Decode attention in one launch (cpu: Backend::attention, the same rounding): block (h, t) computes query head h
// of token t against cells first..=pos[t] (first = pos + 1 - window with a window), reading its position from the
// device, so the launch's arguments do not change from one decode step to the next (CUDA graphs). Scores go to
// scores[(t * n_head + h) * n_ctx ...]; out is [n_tok][n_head][dv]. Block 256 threads (8 warps).
extern "C" __global__ void attn_decode(const float* __restrict__ q, const u8* __restrict__ k,
                                       const u8* __restrict__ v, float* __restrict__ scores,
                                       float* __restrict__ out, const unsigned int* __restrict__ pos, int n_head,
                                       int n_head_kv, int dk, int dv, float scale, int window, long long krb,
                                       int khb, int kty, long long vrb, int vhb, int vty, int n_ctx) {
    __shared__ float red[8];
    __shared__ double redd[8];
    __shared__ float pv[256];
    int h = blockIdx.x, t = blockIdx.y, th = t * n_head + h;
    int g = h / (n_head / n_head_kv);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = (int)pos[t];
    int first = window > 0 ? max(0, p + 1 - window) : 0;
    int n = p + 1 - first;
    float* sc = scores + (long long)th * n_ctx;
    const float* qv = q + (long long)th * dk;
    for (int j = warp; j < n; j += 8) {
        float acc = 0.f;
        for (int d = lane; d < dk; d += 32) {
            float a = qv[d];
            if (kty == 0) a = round_f16(a);
            acc += a * kv_load(k, krb, khb, kty, first + j, g, d);
        }
        acc = warp_sum(acc);
        if (lane == 0) sc[j] = scale * acc;
    }
    __syncthreads();
    float m = -STRATA_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sc[j]);
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
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float pr = sc[j] * inv;
        sc[j] = vty == 0 ? round_f16(pr) : pr;
    }
    __syncthreads();
    // P.V: the block's threads split into groups of dv (rounded up to warps), each group taking every
    // groups-th key; the groups' sums meet in shared memory.
    int per = (dv + 31) & ~31;
    int groups = max(1, (int)blockDim.x / per);
    int grp = threadIdx.x / per, d = threadIdx.x % per;
    float acc = 0.f;
    if (grp < groups && d < dv)
        for (int j = grp; j < n; j += groups) {
            float w = sc[j];
            if (w != 0.f) acc += w * kv_load(v, vrb, vhb, vty, first + j, g, d);
        }
    float* o = out + (long long)th * dv;
    for (int gi = 0; gi < groups; ++gi) {
        if (grp == gi && d < dv) {
            if (gi == 0) pv[d] = acc; else pv[d] += acc;
        }
        __syncthreads();
    }
    if (threadIdx.x < dv) o[threadIdx.x] = pv[threadIdx.x];
}
