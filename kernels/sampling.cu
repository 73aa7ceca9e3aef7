// The largest logits of a decode step, found on the device so that only TOP_LOGITS candidates (not the whole
// vocabulary) go back to the host sampler (cpu: runtime/sampling.rs, TopLogits::from_logits is the reference).
//
// A logit's key orders the candidates exactly as the host sampler does (by_logit_desc: the value in IEEE total
// order, descending, then the lowest id): key = (ordered bits << 32) | (0xFFFFFFFF - id), with ordered bits of a
// NaN 0 (below every number) and otherwise the sign-flipped bits. The kernels sort the bitwise complement of the
// keys ascending (bitonic sort in shared memory), so the best comes first and padding (~0) last.
//
// top_logits_part: block b sorts logits [b * chunk, (b + 1) * chunk) (chunk <= TOP_SORT) and writes its best
// TOP_LOGITS complemented keys to cand[b * TOP_LOGITS ...] and its count of finite logits to nfin[b]. Grid
// (ceil(n / chunk)), block 1024.
// top_logits_final: one block sorts the n_cand candidates (<= TOP_SORT) and writes the best TOP_LOGITS keys (not
// complemented) to out[0..TOP_LOGITS) and the total of finite logits over nb blocks to out[TOP_LOGITS]. Grid 1,
// block 1024.
#define TOP_LOGITS 64
#define TOP_SORT 4096

__device__ __forceinline__ u64 logit_key(float v, u32 id) {
    u32 b = __float_as_uint(v);
    u32 o = v != v ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - id);
}

// Sorts s[0..TOP_SORT) ascending; every thread of the block calls it.
__device__ __forceinline__ void bitonic_sort_smem(u64* s) {
    for (int k = 2; k <= TOP_SORT; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < TOP_SORT; i += blockDim.x) {
                int p = i ^ j;
                if (p > i) {
                    u64 a = s[i], b = s[p];
                    bool up = (i & k) == 0;
                    if ((a > b) == up) {
                        s[i] = b;
                        s[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024)
    top_logits_part(const float* __restrict__ x, int n, int chunk, u64* __restrict__ cand, u32* __restrict__ nfin) {
    pdl_enter();
    __shared__ u64 s[TOP_SORT];
    __shared__ u32 fin;
    int b = blockIdx.x, lo = b * chunk, hi = min(n, lo + chunk);
    if (threadIdx.x == 0) fin = 0;
    __syncthreads();
    u32 f = 0;
    for (int i = threadIdx.x; i < TOP_SORT; i += blockDim.x) {
        int id = lo + i;
        u64 key = 0;
        if (id < hi) {
            float v = x[id];
            f += fabsf(v) <= 3.402823466e38f;
            key = logit_key(v, (u32)id);
        }
        s[i] = ~key;
    }
    atomicAdd(&fin, f);
    __syncthreads();
    bitonic_sort_smem(s);
    if (threadIdx.x < TOP_LOGITS) cand[(long long)b * TOP_LOGITS + threadIdx.x] = s[threadIdx.x];
    if (threadIdx.x == 0) nfin[b] = fin;
}

extern "C" __global__ void __launch_bounds__(1024)
    top_logits_final(const u64* __restrict__ cand, int n_cand, const u32* __restrict__ nfin, int nb,
                     u64* __restrict__ out) {
    pdl_enter();
    __shared__ u64 s[TOP_SORT];
    for (int i = threadIdx.x; i < TOP_SORT; i += blockDim.x) s[i] = i < n_cand ? cand[i] : ~0ull;
    __syncthreads();
    bitonic_sort_smem(s);
    if (threadIdx.x < TOP_LOGITS) out[threadIdx.x] = ~s[threadIdx.x];
    if (threadIdx.x == 0) {
        u64 t = 0;
        for (int i = 0; i < nb; ++i) t += nfin[i];
        out[TOP_LOGITS] = t;
    }
}
