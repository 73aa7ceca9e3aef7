// Our own tensor-core GEMM over quantized weights, for prefill: y[r][n] = sum_k W[n][k] * x[r][k], weights
// dequantized to f16 tile by tile in shared memory (no f16 copy of the matrix), activations given in f16 (the
// host converts them once: f32_to_f16), f32 accumulation on mma.m16n8k16. The same kernel serves a dense matrix (one "expert") and a
// MoE layer's experts grouped by expert (each tile of rows names its expert), so one launch runs every expert.
//
// Work list: tiles[3 * i .. 3 * i + 3] = (expert, first row of y, rows <= 128); row r of the work reads row
// xrows[r] of x (the tokens routed to the expert), or row r without xrows. Block: 256 threads (8 warps)
// computing M rows x 128 outputs, each warp 32 rows and a share of the outputs; K in steps of 64: each thread
// dequantizes one 32-value chunk of one weight row and copies M / 4 activations per step, both fetched into
// registers during the step before (GemmW*, below). Grid (ceil(N / 128), tiles). K must be a multiple of 32 (a
// last half step is zero-filled).
//
// Each block takes its tile's height M: the smallest of 32, 64 and 128 that holds the tile's rows and is at least
// min_m. A block dequantizes its 128 weight rows whatever M is; at M = 128 a tile of few rows (an expert with few
// tokens of a short prompt) spent most of its MMAs, fragment loads and activation copies on absent rows. Each
// output is the same sum in the same order at every M (one mma.m16n8k16 chain over K per element): the same bits.
#define GM_M 128 // the tallest tile (the shared activation tile's rows)
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

// Minimum resident blocks per SM asked of the compiler for the GEMM (GM_MINB): 2, 128 registers (Q4_K: 56 bytes
// spilled with one tile height, 28 with the three of 2026-12-06, ptxas -v),
// two blocks of 8 warps per SM; at 1 the compiler takes 167 registers and one block per SM: the 30B-A3B shape's
// pp512 / pp2048 were 7,790 / 10,367 tok/s at 1 and 8,883 / 11,994 at 2 in one call on the H200
// (reports/2026-11-30-h200-f32e642). A tuning run may set it (STRATA_KERNEL_DEFINES).
#ifndef GM_MINB
#define GM_MINB 2
#endif

// One block of the GEMM at tile height M (see above), for the tile (expert, r0, rows); xs and ws: the block's
// shared tiles (128 rows each). Per K step: the chunk fetched last step goes to shared memory, the next step's
// chunk and activations are fetched (loads in flight during this step's MMAs), then the MMAs.
template <class W, int M>
__device__ __forceinline__ void gemm_block(const u8* __restrict__ w, long long expert_stride, long long row_bytes,
                                           const u16* __restrict__ x, const unsigned int* __restrict__ xrows,
                                           float* __restrict__ y, int expert, int r0, int rows, int N, int K,
                                           u16* xs, u16* ws) {
    // Warps WARPS_M by 8 / WARPS_M, each 32 rows by WN outputs.
    constexpr int WARPS_M = M / 32, WN = GM_N / (8 / WARPS_M), NB = WN / 8;
    // Activations: 256 / M threads a row, each XH halves (XV 16-byte loads) of the step's 64.
    constexpr int XT = 256 / M, XH = GM_K / XT, XV = XH / 8;
    static_assert(M <= GM_M && M % 32 == 0 && XT * XH == GM_K && XV * 8 == XH, "a tile height the layout covers");
    int n0 = blockIdx.x * GM_N;
    const u8* we = w + (long long)expert * expert_stride;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
    int wm = (warp % WARPS_M) * 32, wn = (warp / WARPS_M) * WN;
    // Weight tile row tr = threadIdx.x / 2: row n0 + tr, chunk k0 / 32 + threadIdx.x % 2.
    int tr = threadIdx.x >> 1, ch = threadIdx.x & 1, n = n0 + tr;
    // Activation tile row xr, values xk.. xk + XH of the step.
    int xr = threadIdx.x / XT, xk = (threadIdx.x % XT) * XH;
    long long xrow = xr < rows ? (xrows ? (long long)xrows[r0 + xr] : (long long)(r0 + xr)) : -1;
    W wq;
    uint4 xv[XV];
    float acc[2][NB][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) acc[mb][nb][0] = acc[mb][nb][1] = acc[mb][nb][2] = acc[mb][nb][3] = 0.f;
    // The thread's weight chunk (wq) and activations (xv) of the K step at k0.
    auto fetch = [&](int k0) {
        int c = k0 / 32 + ch;
        wq.fetch(n < N && 32 * c < K ? we + (long long)n * row_bytes : nullptr, c);
        int k = k0 + xk;
        const uint4* src = (const uint4*)(x + (xrow >= 0 ? xrow * K + k : 0));
#pragma unroll
        for (int i = 0; i < XV; ++i) xv[i] = xrow >= 0 && k + 8 * i < K ? src[i] : make_uint4(0u, 0u, 0u, 0u);
    };
    fetch(0);
    for (int k0 = 0; k0 < K; k0 += GM_K) {
        __syncthreads();
        {
            float v[32];
            wq.convert(v);
            u32* dst = (u32*)(ws + tr * GM_PAD + 32 * ch);
#pragma unroll
            for (int i = 0; i < 16; ++i) dst[i] = pack_h2(f2h(v[2 * i]), f2h(v[2 * i + 1]));
            uint4* xd = (uint4*)(xs + xr * GM_PAD + xk);
#pragma unroll
            for (int i = 0; i < XV; ++i) xd[i] = xv[i];
        }
        if (k0 + GM_K < K) fetch(k0 + GM_K);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GM_K; kk += 16) {
            u32 a[2][4];
#pragma unroll
            for (int mb = 0; mb < 2; ++mb) {
                const u16* xrp = xs + (wm + 16 * mb + gid) * GM_PAD + kk + t4 * 2;
                a[mb][0] = *(const u32*)xrp;
                a[mb][1] = *(const u32*)(xrp + 8 * GM_PAD);
                a[mb][2] = *(const u32*)(xrp + 8);
                a[mb][3] = *(const u32*)(xrp + 8 * GM_PAD + 8);
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const u16* wt = ws + (wn + nb * 8 + gid) * GM_PAD + kk + t4 * 2;
                u32 b0 = *(const u32*)wt, b1 = *(const u32*)(wt + 8);
                mma_16816(acc[0][nb], a[0], b0, b1);
                mma_16816(acc[1][nb], a[1], b0, b1);
            }
        }
    }
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int m = wm + 16 * mb + gid + 8 * (e >> 1), nn = n0 + wn + nb * 8 + t4 * 2 + (e & 1);
                if (m < rows && nn < N) y[(long long)(r0 + m) * N + nn] = acc[mb][nb][e];
            }
}

// min_m: the least tile height (32, 64 or 128; the host's STRATA_GEMM_MIN_TILE).
#define STRATA_GEMM(name, W)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256, GM_MINB)                                                 \
        gemm_##name(const u8* __restrict__ w, long long expert_stride, long long row_bytes,                    \
                    const u16* __restrict__ x, const unsigned int* __restrict__ xrows, float* __restrict__ y,  \
                    const int* __restrict__ tiles, int N, int K, int min_m) {                                  \
        __shared__ __align__(16) u16 xs[GM_M * GM_PAD];                                                        \
        __shared__ __align__(16) u16 ws[GM_N * GM_PAD];                                                        \
        pdl_enter();                                                                                           \
        int tile = blockIdx.y;                                                                                 \
        int expert = tiles[3 * tile], r0 = tiles[3 * tile + 1], rows = tiles[3 * tile + 2];                    \
        if (rows <= 32 && min_m <= 32)                                                                         \
            gemm_block<W, 32>(w, expert_stride, row_bytes, x, xrows, y, expert, r0, rows, N, K, xs, ws);       \
        else if (rows <= 64 && min_m <= 64)                                                                    \
            gemm_block<W, 64>(w, expert_stride, row_bytes, x, xrows, y, expert, r0, rows, N, K, xs, ws);       \
        else                                                                                                   \
            gemm_block<W, 128>(w, expert_stride, row_bytes, x, xrows, y, expert, r0, rows, N, K, xs, ws);      \
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
