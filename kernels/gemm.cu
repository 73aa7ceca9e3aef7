// Our own tensor-core GEMM over quantized weights, for prefill: y[r][n] = sum_k W[n][k] * x[r][k], weights
// dequantized to f16 tile by tile in shared memory (no f16 copy of the matrix), activations given in f16 (the
// host converts them once: f32_to_f16), f32 accumulation on mma.m16n8k16. The same kernel serves a dense matrix (one "expert") and a
// MoE layer's experts grouped by expert (each tile of rows names its expert), so one launch runs every expert.
//
// Work list: tiles[3 * i .. 3 * i + 3] = (expert, first row of y, rows <= 128); row r of the work reads row
// xrows[r] of x (the tokens routed to the expert), or row r without xrows. Block: 256 threads (8
// warps) computing 128 rows x 128 outputs, warp w taking rows 32 (w & 3).. and outputs 64 (w >> 2)..; K in steps
// of 64: each thread dequantizes one 32-value chunk of one weight row and copies 32 activations per step, both
// fetched into registers during the step before (GemmW*, below). Grid (ceil(N / 128), tiles). K must be a multiple
// of 32 (a last half step is zero-filled).
#define GM_M 128
#define GM_N 128
#define GM_K 64
#define GM_PAD 72 // row stride of the shared tiles in halves (64 + 8: no bank conflicts on fragment loads)

// A thread's 32-value weight chunk of one K step, fetched a step ahead (its loads in flight during the step's MMAs)
// and dequantized at the next. GemmWAny keeps the address (its dequantizer loads as it converts); Q4_K's
// (Q4kChunk, quant.cuh) holds the chunk's bytes.
template <void (*DQ)(const u8*, int, float*)>
struct GemmWAny {
    const u8* row;
    int c;
    __device__ __forceinline__ void fetch(const u8* r, int cc) { row = r, c = cc; }
    __device__ __forceinline__ void convert(float* v) const {
        if (row) {
            DQ(row, c, v);
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) v[i] = 0.f;
        }
    }
};
#define GEMM_W_q4_k Q4kChunk

// The thread's weight chunk (wq) and activations (xv) of the K step at k0.
#define GEMM_FETCH(k0)                                                                                         \
    {                                                                                                          \
        int c_ = (k0) / 32 + ch, k_ = (k0) + 32 * ch;                                                          \
        wq.fetch(n < N && 32 * c_ < K ? we + (long long)n * row_bytes : nullptr, c_);                          \
        const uint4* src_ = (const uint4*)(x + (xrow >= 0 ? xrow * K + k_ : 0));                               \
        _Pragma("unroll") for (int i = 0; i < 4; ++i)                                                          \
            xv[i] = xrow >= 0 && k_ + 8 * i < K ? src_[i] : make_uint4(0u, 0u, 0u, 0u);                        \
    }
// Minimum resident blocks per SM asked of the compiler for the GEMM (GM_MINB): 2, 128 registers (56 bytes spilled),
// two blocks of 8 warps per SM; at 1 the compiler takes 167 registers and one block per SM: the 30B-A3B shape's
// pp512 / pp2048 were 7,790 / 10,367 tok/s at 1 and 8,883 / 11,994 at 2 in one call on the H200
// (reports/2026-11-30-h200-f32e642). A tuning run may set it (STRATA_KERNEL_DEFINES).
#ifndef GM_MINB
#define GM_MINB 2
#endif

// Per K step: the chunk fetched last step goes to shared memory, the next step's chunk and activations are
// fetched (loads in flight during this step's MMAs), then the MMAs.
#define STRATA_GEMM(name, W)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256, GM_MINB)                                                 \
        gemm_##name(const u8* __restrict__ w, long long expert_stride, long long row_bytes,                    \
                    const u16* __restrict__ x, const unsigned int* __restrict__ xrows,                         \
                    float* __restrict__ y, const int* __restrict__ tiles, int N, int K) {                      \
        __shared__ __align__(16) u16 xs[GM_M * GM_PAD];                                                        \
        __shared__ __align__(16) u16 ws[GM_N * GM_PAD];                                                        \
        int tile = blockIdx.y, n0 = blockIdx.x * GM_N;                                                         \
        pdl_enter();                                                                                           \
        int expert = tiles[3 * tile], r0 = tiles[3 * tile + 1], rows = tiles[3 * tile + 2];                    \
        const u8* we = w + (long long)expert * expert_stride;                                                  \
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;                  \
        int wm = (warp & 3) * 32, wn = (warp >> 2) * 64;                                                       \
        /* Tile row tr = threadIdx.x / 2 of both tiles: weight row n0 + tr, chunk k0 / 32 + threadIdx.x % 2,  \
           and half of x's row tr (f16; 128 rows x 64 values, four 16-byte loads). */                          \
        int tr = threadIdx.x >> 1, ch = threadIdx.x & 1, n = n0 + tr;                                          \
        long long xrow = tr < rows ? (xrows ? (long long)xrows[r0 + tr] : (long long)(r0 + tr)) : -1;         \
        W wq;                                                                                                  \
        uint4 xv[4];                                                                                           \
        float acc[2][8][4];                                                                                    \
        _Pragma("unroll") for (int i = 0; i < 16; ++i) acc[i >> 3][i & 7][0] = acc[i >> 3][i & 7][1] =          \
            acc[i >> 3][i & 7][2] = acc[i >> 3][i & 7][3] = 0.f;                                               \
        GEMM_FETCH(0);                                                                                         \
        for (int k0 = 0; k0 < K; k0 += GM_K) {                                                                 \
            __syncthreads();                                                                                   \
            {                                                                                                  \
                float v[32];                                                                                   \
                wq.convert(v);                                                                                 \
                u32* dst = (u32*)(ws + tr * GM_PAD + 32 * ch);                                                 \
                _Pragma("unroll") for (int i = 0; i < 16; ++i) dst[i] = pack_h2(f2h(v[2 * i]), f2h(v[2 * i + 1])); \
                uint4* xd = (uint4*)(xs + tr * GM_PAD + 32 * ch);                                              \
                _Pragma("unroll") for (int i = 0; i < 4; ++i) xd[i] = xv[i];                                   \
            }                                                                                                  \
            if (k0 + GM_K < K) GEMM_FETCH(k0 + GM_K);                                                          \
            __syncthreads();                                                                                   \
            _Pragma("unroll") for (int kk = 0; kk < GM_K; kk += 16) {                                          \
                u32 a[2][4];                                                                                   \
                _Pragma("unroll") for (int mb = 0; mb < 2; ++mb) {                                             \
                    const u16* xr = xs + (wm + 16 * mb + gid) * GM_PAD + kk + t4 * 2;                          \
                    a[mb][0] = *(const u32*)xr;                                                                \
                    a[mb][1] = *(const u32*)(xr + 8 * GM_PAD);                                                 \
                    a[mb][2] = *(const u32*)(xr + 8);                                                          \
                    a[mb][3] = *(const u32*)(xr + 8 * GM_PAD + 8);                                             \
                }                                                                                              \
                _Pragma("unroll") for (int nb = 0; nb < 8; ++nb) {                                             \
                    const u16* wt = ws + (wn + nb * 8 + gid) * GM_PAD + kk + t4 * 2;                           \
                    u32 b0 = *(const u32*)wt, b1 = *(const u32*)(wt + 8);                                      \
                    mma_16816(acc[0][nb], a[0], b0, b1);                                                       \
                    mma_16816(acc[1][nb], a[1], b0, b1);                                                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("unroll") for (int mb = 0; mb < 2; ++mb)                                                       \
            _Pragma("unroll") for (int nb = 0; nb < 8; ++nb)                                                   \
                _Pragma("unroll") for (int e = 0; e < 4; ++e) {                                                \
                    int m = wm + 16 * mb + gid + 8 * (e >> 1), n = n0 + wn + nb * 8 + t4 * 2 + (e & 1);        \
                    if (m < rows && n < N) y[(long long)(r0 + m) * N + n] = acc[mb][nb][e];                    \
                }                                                                                              \
    }

// The weight fetch per type: GEMM_W_T where defined (Q4_K), else the address and the type's chunk dequantizer.
#define GEMM_W_f32 GemmWAny<DQ_FAST_f32>
#define GEMM_W_f16 GemmWAny<DQ_FAST_f16>
#define GEMM_W_bf16 GemmWAny<DQ_FAST_bf16>
#define GEMM_W_q4_0 GemmWAny<DQ_FAST_q4_0>
#define GEMM_W_q4_1 GemmWAny<DQ_FAST_q4_1>
#define GEMM_W_q5_0 GemmWAny<DQ_FAST_q5_0>
#define GEMM_W_q5_1 GemmWAny<DQ_FAST_q5_1>
#define GEMM_W_q8_0 GemmWAny<DQ_FAST_q8_0>
#define GEMM_W_q2_k GemmWAny<DQ_FAST_q2_k>
#define GEMM_W_q3_k GemmWAny<DQ_FAST_q3_k>
#define GEMM_W_q5_k GemmWAny<DQ_FAST_q5_k>
#define GEMM_W_q6_k GemmWAny<DQ_FAST_q6_k>
#define STRATA_GEMM_OF(name, dq) STRATA_GEMM(name, GEMM_W_##name)
STRATA_FOR_EACH_QTYPE(STRATA_GEMM_OF)
