// Quantized matrix-vector products and dequantization to f16, one kernel of each per block type.
//
// mmv_T: y[t][r] = sum_c W[r][c] * x[t][c]. One warp per row; lane l takes the 32-value chunks l, l+32, ...
// of the row, so a warp reads a row once per token. Grid (ceil(rows / 8), n_tok), block 256 (8 warps).
// Activations stay f32 (the CPU quantizes them to int8 first: the two differ by that rounding only).
//
// dq_f16_T: dequantizes `rows` rows into f16, [rows][cols], for the prefill GEMM. One thread per chunk.
#define STRATA_MMV(name, dq)                                                                                   \
    extern "C" __global__ void mmv_##name(const u8* __restrict__ w, const float* __restrict__ x,              \
                                          float* __restrict__ y, int rows, int cols, long long row_bytes) {   \
        int r = blockIdx.x * 8 + (threadIdx.x >> 5);                                                         \
        int lane = threadIdx.x & 31, t = blockIdx.y;                                                          \
        if (r >= rows) return;                                                                                \
        const u8* row = w + (long long)r * row_bytes;                                                         \
        const float* xt = x + (long long)t * cols;                                                            \
        float acc = 0.f, v[32];                                                                               \
        for (int c = lane; c < cols / 32; c += 32) {                                                          \
            dq(row, c, v);                                                                                    \
            const float4* x4 = (const float4*)(xt + 32 * c);                                                  \
            for (int i = 0; i < 8; ++i) {                                                                     \
                float4 a = x4[i];                                                                             \
                acc += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;         \
            }                                                                                                 \
        }                                                                                                     \
        acc = warp_sum(acc);                                                                                  \
        if (lane == 0) y[(long long)t * rows + r] = acc;                                                      \
    }                                                                                                         \
    extern "C" __global__ void dq_f16_##name(const u8* __restrict__ w, u16* __restrict__ out, int rows,       \
                                             int cols, long long row_bytes) {                                 \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        int per_row = cols / 32;                                                                              \
        if (i >= (long long)rows * per_row) return;                                                           \
        int r = (int)(i / per_row), c = (int)(i % per_row);                                                   \
        float v[32];                                                                                          \
        dq(w + (long long)r * row_bytes, c, v);                                                               \
        u16* o = out + (long long)r * cols + 32 * c;                                                          \
        for (int l = 0; l < 32; ++l) o[l] = f2h(v[l]);                                                        \
    }

STRATA_FOR_EACH_QTYPE(STRATA_MMV)

// f32 -> f16 bits, n values (the GEMM's activations).
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}

// Our own GEMM for when the library's fails (seed 000): out[t][r] = sum_c W16[r][c] * X16[t][c] over f16
// operands with f32 accumulation, 16x16 output tiles through shared memory. Grid (ceil(rows/16),
// ceil(n_tok/16)), block (16, 16).
extern "C" __global__ void gemm_f16_tiled(const u16* __restrict__ w, const u16* __restrict__ x,
                                          float* __restrict__ out, int rows, int cols, int n_tok) {
    __shared__ float ws[16][17];
    __shared__ float xs[16][17];
    int tr = threadIdx.y, tc = threadIdx.x;
    int r = blockIdx.x * 16 + tr;    // this thread loads W row r
    int t = blockIdx.y * 16 + tr;    // and X row t
    int orow = blockIdx.x * 16 + tc; // and computes out[ot][orow]
    int ot = blockIdx.y * 16 + tr;
    float acc = 0.f;
    for (int k0 = 0; k0 < cols; k0 += 16) {
        ws[tr][tc] = (r < rows && k0 + tc < cols) ? h2f(w[(long long)r * cols + k0 + tc]) : 0.f;
        xs[tr][tc] = (t < n_tok && k0 + tc < cols) ? h2f(x[(long long)t * cols + k0 + tc]) : 0.f;
        __syncthreads();
        for (int k = 0; k < 16; ++k) acc += ws[tc][k] * xs[tr][k];
        __syncthreads();
    }
    if (orow < rows && ot < n_tok) out[(long long)ot * rows + orow] = acc;
}
