// The largest logits of a decode step, found on the device so that only TOP_LOGITS candidates (not the whole
// vocabulary) go back to the host sampler (cpu: runtime/sampling.rs, TopLogits::from_logits is the reference).
//
// A logit's key orders the candidates exactly as the host sampler does (by_logit_desc: the value in IEEE total
// order, descending, then the lowest id): key = (ordered bits << 32) | (0xFFFFFFFF - id), with ordered bits of a
// NaN 0 (below every number) and otherwise the sign-flipped bits, -0 taken as +0 (greedy ties them); padding is
// key 0. A block keeps the best 64 of
// its 4096 keys (block_top64: warp-level bitonic sorts in registers, then a merge tree).
//
// top_logits_part: block b takes logits [b * chunk, (b + 1) * chunk) (chunk <= TOP_SORT) and writes its best
// TOP_LOGITS keys, best first, to cand[b * TOP_LOGITS ...] and its count of finite logits to nfin[b]. Grid
// (ceil(n / chunk)), block 1024.
// top_logits_final: one block takes the n_cand candidates (<= TOP_SORT) and writes the best TOP_LOGITS keys to
// out[0..TOP_LOGITS) and the total of finite logits over nb blocks to out[TOP_LOGITS]. Grid 1,
// block 1024.
#define TOP_LOGITS 64
#define TOP_SORT 4096

__device__ __forceinline__ u64 logit_key(float v, u32 id) {
    u32 b = __float_as_uint(v + 0.0f); // -0 as +0 (IEEE: -0 + +0 = +0; no fast-math in these kernels)
    u32 o = v != v ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - id);
}

// The 128 keys of a warp (lane l holds elements 4 l .. 4 l + 3 in v) sorted into descending order: a bitonic
// network in registers, partners in the same lane (j < 4) or across lanes by shuffles; no block barrier.
__device__ __forceinline__ void warp_sort128_desc(u64* v) {
    int lane = threadIdx.x & 31;
    for (int k = 2; k <= 128; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            u64 o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) o[e] = j < 4 ? v[e ^ j] : __shfl_xor_sync(0xffffffffu, v[e], j >> 2);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int i = 4 * lane + e;
                bool want_max = ((i & j) == 0) == ((i & k) == 0);
                v[e] = want_max ? (v[e] > o[e] ? v[e] : o[e]) : (v[e] < o[e] ? v[e] : o[e]);
            }
        }
}

// The best TOP_LOGITS of the block's 4096 keys (thread t holds elements 4 t .. 4 t + 3 in v; padding 0), sorted
// best first, into lists[0 .. TOP_LOGITS): every warp sorts its 128 and keeps 64, then pairs of lists merge (the
// elementwise maximum of one list and the other reversed is a bitonic sequence holding the best 64 of both; six
// more steps sort it) until one is left. Block 1024 threads; every thread calls it.
__device__ __forceinline__ void block_top64(u64* v, u64 (*lists)[TOP_LOGITS]) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    warp_sort128_desc(v);
    if (lane < 16)
#pragma unroll
        for (int e = 0; e < 4; ++e) lists[warp][4 * lane + e] = v[e];
    __syncthreads();
    for (int n = 32; n > 1; n >>= 1) {
        u64 c[2];
        bool active = warp < n / 2;
        if (active)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int i = 2 * lane + e;
                u64 a = lists[2 * warp][i], b = lists[2 * warp + 1][TOP_LOGITS - 1 - i];
                c[e] = a > b ? a : b;
            }
        __syncthreads();
        if (active) {
            for (int j = TOP_LOGITS / 2; j > 0; j >>= 1) {
                u64 o[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) o[e] = j < 2 ? c[e ^ j] : __shfl_xor_sync(0xffffffffu, c[e], j >> 1);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    bool want_max = ((2 * lane + e) & j) == 0;
                    c[e] = want_max ? (c[e] > o[e] ? c[e] : o[e]) : (c[e] < o[e] ? c[e] : o[e]);
                }
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) lists[warp][2 * lane + e] = c[e];
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(1024)
    top_logits_part(const float* __restrict__ x, int n, int chunk, u64* __restrict__ cand, u32* __restrict__ nfin) {
    pdl_enter();
    __shared__ u64 lists[32][TOP_LOGITS];
    __shared__ u32 fin;
    int b = blockIdx.x, lo = b * chunk, hi = min(n, lo + chunk);
    if (threadIdx.x == 0) fin = 0;
    __syncthreads();
    u32 f = 0;
    u64 v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int id = lo + 4 * threadIdx.x + e;
        v[e] = 0;
        if (4 * (int)threadIdx.x + e < TOP_SORT && id < hi) {
            float xv = x[id];
            f += fabsf(xv) <= 3.402823466e38f;
            v[e] = logit_key(xv, (u32)id);
        }
    }
    atomicAdd(&fin, f);
    block_top64(v, lists);
    if (threadIdx.x < TOP_LOGITS) cand[(long long)b * TOP_LOGITS + threadIdx.x] = lists[0][threadIdx.x];
    if (threadIdx.x == 0) nfin[b] = fin;
}

extern "C" __global__ void __launch_bounds__(1024)
    top_logits_final(const u64* __restrict__ cand, int n_cand, const u32* __restrict__ nfin, int nb,
                     u64* __restrict__ out) {
    pdl_enter();
    __shared__ u64 lists[32][TOP_LOGITS];
    u64 v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int i = 4 * threadIdx.x + e;
        v[e] = i < n_cand ? cand[i] : 0ull;
    }
    block_top64(v, lists);
    if (threadIdx.x < TOP_LOGITS) out[threadIdx.x] = lists[0][threadIdx.x];
    if (threadIdx.x == 0) {
        u64 t = 0;
        for (int i = 0; i < nb; ++i) t += nfin[i];
        out[TOP_LOGITS] = t;
    }
}
