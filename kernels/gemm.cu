// Our own tensor-core GEMM over quantized weights, for prefill: y[r][n] = sum_k W[n][k] * x[r][k], weights
// dequantized to f16 tile by tile in shared memory (no f16 copy of the matrix), activations given in f16 (the
// host converts them once: f32_to_f16), f32 accumulation on mma.m16n8k16. The same kernel serves a dense matrix (one "expert") and a
// MoE layer's experts grouped by expert (each tile of rows names its expert), so one launch runs every expert.
//
// Work list: tiles[3 * i .. 3 * i + 3] = (expert, first row of y, rows <= 128); row r of the work reads row
// xrows[r] of x (the tokens routed to the expert), or row r without xrows. Block: 256 threads (8
// warps) computing 128 rows x 128 outputs, warp w taking rows 32 (w & 3).. and outputs 64 (w >> 2)..; K in steps
// of 64: each thread dequantizes one 32-value chunk of one weight row and converts 32 activations per step. Grid
// (ceil(N / 128), tiles). K must be a multiple of 32 (a last half step is zero-filled).
#define GM_M 128
#define GM_N 128
#define GM_K 64
#define GM_PAD 72 // row stride of the shared tiles in halves (64 + 8: no bank conflicts on fragment loads)

#define STRATA_GEMM(name, dq)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
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
        float acc[2][8][4];                                                                                    \
        for (int i = 0; i < 16; ++i) acc[i >> 3][i & 7][0] = acc[i >> 3][i & 7][1] = acc[i >> 3][i & 7][2] =   \
            acc[i >> 3][i & 7][3] = 0.f;                                                                       \
        for (int k0 = 0; k0 < K; k0 += GM_K) {                                                                 \
            __syncthreads();                                                                                   \
            {                                                                                                  \
                /* Weight row threadIdx.x / 2, chunk k0 / 32 + threadIdx.x % 2, dequantized to f16. */        \
                int wr = threadIdx.x >> 1, ch = threadIdx.x & 1, n = n0 + wr, c = k0 / 32 + ch;              \
                float v[32];                                                                                   \
                if (n < N && 32 * c < K) {                                                                     \
                    dq(we + (long long)n * row_bytes, c, v);                                                   \
                } else {                                                                                       \
                    for (int i = 0; i < 32; ++i) v[i] = 0.f;                                                   \
                }                                                                                              \
                u32* dst = (u32*)(ws + wr * GM_PAD + 32 * ch);                                                 \
                for (int i = 0; i < 16; ++i) dst[i] = (u32)f2h(v[2 * i]) | ((u32)f2h(v[2 * i + 1]) << 16);     \
            }                                                                                                  \
            {                                                                                                  \
                /* Half a row of x (f16) per thread: 128 rows x 64 values, four 16-byte loads. */             \
                int m = threadIdx.x >> 1, k = k0 + 32 * (threadIdx.x & 1);                                     \
                uint4* dst = (uint4*)(xs + m * GM_PAD + 32 * (threadIdx.x & 1));                               \
                long long xr = m < rows ? (xrows ? (long long)xrows[r0 + m] : (long long)(r0 + m)) : 0;        \
                const uint4* src = (const uint4*)(x + xr * K + k);                                             \
                for (int i = 0; i < 4; ++i)                                                                    \
                    dst[i] = m < rows && k + 8 * i < K ? src[i] : make_uint4(0u, 0u, 0u, 0u);                  \
            }                                                                                                  \
            __syncthreads();                                                                                   \
            for (int kk = 0; kk < GM_K; kk += 16) {                                                            \
                u32 a[2][4];                                                                                   \
                for (int mb = 0; mb < 2; ++mb) {                                                               \
                    const u16* xr = xs + (wm + 16 * mb + gid) * GM_PAD + kk + t4 * 2;                          \
                    a[mb][0] = *(const u32*)xr;                                                                \
                    a[mb][1] = *(const u32*)(xr + 8 * GM_PAD);                                                 \
                    a[mb][2] = *(const u32*)(xr + 8);                                                          \
                    a[mb][3] = *(const u32*)(xr + 8 * GM_PAD + 8);                                             \
                }                                                                                              \
                for (int nb = 0; nb < 8; ++nb) {                                                               \
                    const u16* wr = ws + (wn + nb * 8 + gid) * GM_PAD + kk + t4 * 2;                           \
                    u32 b0 = *(const u32*)wr, b1 = *(const u32*)(wr + 8);                                      \
                    mma_16816(acc[0][nb], a[0], b0, b1);                                                       \
                    mma_16816(acc[1][nb], a[1], b0, b1);                                                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int mb = 0; mb < 2; ++mb)                                                                         \
            for (int nb = 0; nb < 8; ++nb)                                                                     \
                for (int e = 0; e < 4; ++e) {                                                                  \
                    int m = wm + 16 * mb + gid + 8 * (e >> 1), n = n0 + wn + nb * 8 + t4 * 2 + (e & 1);        \
                    if (m < rows && n < N) y[(long long)(r0 + m) * N + n] = acc[mb][nb][e];                    \
                }                                                                                              \
    }

#define STRATA_GEMM_OF(name, dq) STRATA_GEMM(name, DQ_FAST_##name)
STRATA_FOR_EACH_QTYPE(STRATA_GEMM_OF)
