// Quantized matrix-vector products, embedding lookup and dequantization to f16, one kernel of each per type.
//
// A row's dot product (mmv_dot_T) is one warp's: lane l takes the 32-value chunks l, l+32, ... of the row, so a
// warp reads a row once per token. Activations stay f32 (the CPU quantizes them to int8 first: the two differ by
// that rounding only).
//
// mmv_T: y_m[t][r] = sum_c W_m[r][c] * x[t][c] for up to three matrices m of one type and width that read the
// same activations (a layer's q/k/v, or gate/up): their rows are numbered one after another, r0 + r1 + r2 in
// all; a matrix of 0 rows is absent. Grid (ceil((r0 + r1 + r2) / 8), n_tok), block 256 (8 warps, a row each).
//
// mmv_moe_T: the experts of a MoE layer at decode. Slot s (token s / x_div's i-th expert) multiplies expert
// ids[s]'s rows of the stacked tensor wa (and wb when blockIdx.z is 1: gate and up in one launch) by activation
// row s / x_div: ya[s][r]. Grid (ceil(rows / 8), n_slots, 1 or 2), block 256.
//
// get_rows_T: out[t] = row ids[t] of W dequantized (embeddings). One thread per 32-value chunk.
//
// dq_f16_T: dequantizes `rows` rows into f16, [rows][cols], for the prefill GEMM. One thread per chunk.
#define STRATA_MMV(name, dq)                                                                                   \
    __device__ __forceinline__ float mmv_dot_##name(const u8* __restrict__ row, const float* __restrict__ xt,  \
                                                    int cols, int lane) {                                     \
        float acc = 0.f, v[32];                                                                               \
        for (int c = lane; c < cols / 32; c += 32) {                                                          \
            dq(row, c, v);                                                                                    \
            const float4* x4 = (const float4*)(xt + 32 * c);                                                  \
            for (int i = 0; i < 8; ++i) {                                                                     \
                float4 a = x4[i];                                                                             \
                acc += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;         \
            }                                                                                                 \
        }                                                                                                     \
        return warp_sum(acc);                                                                                 \
    }                                                                                                         \
    extern "C" __global__ void mmv_##name(const u8* __restrict__ w0, const u8* __restrict__ w1,              \
                                          const u8* __restrict__ w2, const float* __restrict__ x,            \
                                          float* __restrict__ y0, float* __restrict__ y1,                    \
                                          float* __restrict__ y2, int r0, int r1, int r2, int cols,          \
                                          long long row_bytes) {                                              \
        int r = blockIdx.x * 8 + (threadIdx.x >> 5);                                                         \
        int lane = threadIdx.x & 31, t = blockIdx.y;                                                          \
        const u8* w;                                                                                          \
        float* y;                                                                                             \
        int rows;                                                                                             \
        if (r < r0) {                                                                                         \
            w = w0, y = y0, rows = r0;                                                                        \
        } else if ((r -= r0) < r1) {                                                                          \
            w = w1, y = y1, rows = r1;                                                                        \
        } else if ((r -= r1) < r2) {                                                                          \
            w = w2, y = y2, rows = r2;                                                                        \
        } else {                                                                                              \
            return;                                                                                           \
        }                                                                                                     \
        float acc = mmv_dot_##name(w + (long long)r * row_bytes, x + (long long)t * cols, cols, lane);        \
        if (lane == 0) y[(long long)t * rows + r] = acc;                                                      \
    }                                                                                                         \
    extern "C" __global__ void mmv_moe_##name(const u8* __restrict__ wa, const u8* __restrict__ wb,          \
                                              const float* __restrict__ x, float* __restrict__ ya,           \
                                              float* __restrict__ yb, const u32* __restrict__ ids, int x_div, \
                                              int rows, int cols, long long row_bytes) {                      \
        int r = blockIdx.x * 8 + (threadIdx.x >> 5);                                                         \
        int lane = threadIdx.x & 31, s = blockIdx.y;                                                          \
        if (r >= rows) return;                                                                                \
        const u8* w = (blockIdx.z ? wb : wa) + ((long long)ids[s] * rows + r) * row_bytes;                    \
        float acc = mmv_dot_##name(w, x + (long long)(s / x_div) * cols, cols, lane);                         \
        if (lane == 0) (blockIdx.z ? yb : ya)[(long long)s * rows + r] = acc;                                 \
    }                                                                                                         \
    extern "C" __global__ void get_rows_##name(const u8* __restrict__ w, const u32* __restrict__ ids,         \
                                               float* __restrict__ out, int n, int cols, long long row_bytes) { \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        int per_row = cols / 32;                                                                              \
        if (i >= (long long)n * per_row) return;                                                              \
        int t = (int)(i / per_row), c = (int)(i % per_row);                                                   \
        dq(w + (long long)ids[t] * row_bytes, c, out + (long long)t * cols + 32 * c);                         \
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
