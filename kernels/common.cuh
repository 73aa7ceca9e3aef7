// Shared device helpers of every kernel file. NVRTC compiles kernels/*.cu as one program with this header
// first, so no system header is needed (no <cuda_fp16.h>, no <stdint.h>): f16 conversions are single PTX
// instructions.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define STRATA_INF __int_as_float(0x7f800000)

// A paged KV cache (engine/src/state/kv.rs): a sequence's cells are taken in blocks of KV_BLOCK_CELLS from a pool
// whose every layer's keys (and values) are one array of rows, block b at rows b * KV_BLOCK_CELLS..; the sequence's
// page table `pages` names the pool block of each of its blocks. Cell c is row kv_cell(pages, c) of the layer's
// array.
#define KV_BLOCK_CELLS 16
__device__ __forceinline__ long long kv_cell(const u32* __restrict__ pages, int c) {
    u32 u = (u32)c; // cells are never negative: shifts and masks, not signed division
    return (long long)pages[u / KV_BLOCK_CELLS] * KV_BLOCK_CELLS + (u & (KV_BLOCK_CELLS - 1));
}

// f16 bits -> f32 (exact).
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// f32 -> f16 bits, round to nearest even (what half::f16::from_f32 and ggml's conversion do).
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }
__device__ __forceinline__ float bf2f(u16 b) { return __int_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 ld32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// An expert id the MoE expert kernels (mmv_moe_*) skip: the blocks of that routing slot compute nothing
// (expert_lookup writes it to split a layer's experts into hits and misses).
#define MOE_SKIP 0xFFFFFFFFu

// A step of several tokens groups its routing slots by expert (moe_groups, mmv_moe_group_*): at most MOE_GROUP_T
// slots share a group's weight reads (4: ptxas -v through NVRTC, sm_90: 80 registers and 32 bytes spilled for Q4_K
// under MMV_MOE_BOUNDS, 121 registers for Q6_K, 20 KiB of stages; at 8, 196 bytes spilled and 139 registers, one
// Q6_K block per SM; 64 tokens of top-8 over 128 experts route 4 to an expert on average), a group takes MOE_GROUP_INTS ints (id, count, slots), and a step has at most
// MOE_GROUP_MAX_SLOTS slots (cuda/moe.rs holds the same numbers: change both together).
#define MOE_GROUP_T 4
#define MOE_GROUP_INTS (2 + MOE_GROUP_T)
#define MOE_GROUP_MAX_SLOTS 1024

// Programmatic dependent launch (sm_90 and later; the host launches every kernel with the attribute there): a
// kernel may begin while the one before it on the stream still runs. pdl_enter() waits until that kernel has
// completed and its writes are visible, then lets the next kernel begin launching. Every kernel calls it before
// it reads anything an earlier kernel wrote and before it writes anything; only loads of weights (never written
// while kernels run) may come first, and values written two launches back or more read through L2 (ld_cg_*): the
// kernel after next starts only once every block of the next one has waited here, which is after this kernel
// completed, because every kernel waits before it lets its dependents launch (keep it so: the expert down
// projection's ids_early read relies on it). Calling it after a launch without the attribute, or twice, costs nothing.
// Source: PTX ISA, griddepcontrol; CUDA programming guide, "Programmatic Dependent Launch and Synchronization".
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A load from the L2 cache (the point of coherence), never from a multiprocessor's L1: for values an earlier grid
// wrote, read before pdl_enter (a grid that completed before the kernel just before this one began waiting).
__device__ __forceinline__ u32 ld_cg_u32(const u32* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// Whether this block is the last of `blocks` to get here (the "last block" pattern of CUDA's threadFenceReduction
// sample): every thread's earlier global writes are made visible device-wide first, the count at cnt is taken
// atomically, and the last block resets it to 0 for the next launch and may then read what the others wrote (through
// L2: ld_cg_*). Every thread of the block calls it (it synchronises).
__device__ __forceinline__ bool block_is_last(u32* cnt, u32 blocks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(cnt, 1u) == blocks - 1;
        if (last) atomicExch(cnt, 0u);
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Tensor cores: c += a * b for one m16n8k16 tile, f16 operands, f32 accumulation (PTX mma.sync; sm_80 and later).
// a holds the 16x16 row-major A fragment (4 registers of two halves), b0/b1 the 16x8 column-major B fragment.
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack_h2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// The GLU activation of a gate value (cpu: silu / gelu_ggml): act 0 silu, 1 ggml's GELU through f16 (its table's
// rounding), exactly as the CPU computes them.
__device__ __forceinline__ float glu_act(float x, int act) {
    if (act == 0) return x / (1.0f + expf(-x));
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    float r = round_f16(x);
    return round_f16(0.5f * r * (1.0f + tanhf(0.7978846f * r * (1.0f + 0.044715f * r * r))));
}

// The MoE router's choice for one token by the whole block (cpu: route): softmax over the n_expert logits (max,
// exp in f32, sum in f64, times the f32 reciprocal, as softmax_row), then the k largest probabilities, ties to the
// lower id, NaN after every number (lower id first, as the CPU's pick of the lowest unchosen id), each expert's
// place found at once by counting the experts before it (no k rounds of arg-max; n_expert compares per thread);
// renormalised to sum 1 (an f32 sum
// in choice order) when `normalize`. Leaves ids[0..k) and w[0..k) in shared memory, and the probabilities in prob
// (shared, n_expert <= 1024). Every thread of the block calls it (it synchronises); blockDim.x a multiple of 32,
// at most 1024.
__device__ __forceinline__ void moe_route_block(const float* __restrict__ logits, int n_expert, int k, int normalize,
                                                float* prob, u32* ids, float* w) {
    __shared__ float redf[32];
    __shared__ double redd[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float m = -STRATA_INF;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        float x = ld_cg_f32(logits + e);
        prob[e] = x;
        m = fmaxf(m, x);
    }
    m = warp_max(m);
    if (lane == 0) redf[warp] = m;
    __syncthreads();
    m = redf[0];
    for (int i = 1; i < nw; ++i) m = fmaxf(m, redf[i]);
    double s = 0.0;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        float x = expf(prob[e] - m);
        prob[e] = x;
        s += (double)x;
    }
    s = warp_sum_d(s);
    if (lane == 0) redd[warp] = s;
    __syncthreads();
    s = 0.0;
    for (int i = 0; i < nw; ++i) s += redd[i];
    float inv = (float)(1.0 / s);
    // Each expert's key orders the choice: the probability's order-preserving bits above (NaN lowest, -0 as +0),
    // the complemented id below (ties to the lower id); an expert's place is the count of larger keys.
    __shared__ u64 key[1024];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        float x = prob[e] * inv;
        prob[e] = x;
        u32 b = __float_as_uint(x + 0.0f);
        u32 ord = x != x ? 0u : (b & 0x80000000u ? ~b : b | 0x80000000u);
        key[e] = (u64)ord << 32 | (u32)~e;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        u64 ke = key[e];
        int rank = 0;
        // No early exit: the loads stay independent of each other (a test on rank would wait for each in turn).
#pragma unroll 8
        for (int j = 0; j < n_expert; ++j) rank += key[j] > ke;
        if (rank < k) ids[rank] = (u32)e, w[rank] = prob[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int i = 0; i < k; ++i) sum += w[i];
        if (normalize)
            for (int i = 0; i < k; ++i) w[i] /= sum;
    }
    __syncthreads();
}

// One head's per-head RMSNorm (when w is given) then RoPE, in place, by one warp (cpu: rms_norm_row per head, then
// rope_token): the mean of squares in f64, v = v * scale * w; theta = pos * theta_scale^i by repeated
// multiplication (as ggml's rope cache), pairs (i, i + n_rot / 2) with neox, else (2 i, 2 i + 1). v may be global
// or shared memory; the warp's writes are visible to its lanes on return.
__device__ __forceinline__ void head_norm_rope(float* v, const float* __restrict__ w, int head_dim, float eps, int pos,
                                               int n_rot, float theta_scale, float freq_scale, int neox) {
    int lane = threadIdx.x & 31;
    if (w) {
        double ss = 0.0;
        for (int i = lane; i < head_dim; i += 32) ss += (double)v[i] * (double)v[i];
        ss = warp_sum_d(ss);
        float scale = 1.0f / sqrtf((float)(ss / head_dim) + eps);
        for (int i = lane; i < head_dim; i += 32) v[i] = v[i] * scale * w[i];
        __syncwarp();
    }
    int half = n_rot / 2;
    for (int p = lane; p < half; p += 32) {
        float theta = (float)pos;
        for (int i = 0; i < p; ++i) theta *= theta_scale;
        float a = freq_scale * theta;
        float cs = cosf(a), sn = sinf(a);
        int i0 = neox ? p : 2 * p, i1 = neox ? p + half : 2 * p + 1;
        float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * cs - x1 * sn;
        v[i1] = x0 * sn + x1 * cs;
    }
    __syncwarp();
}
