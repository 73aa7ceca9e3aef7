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
    __device__ __forceinline__ float mmv_dot32_##name(const u8* __restrict__ row, const float* __restrict__ xt,  \
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
        float acc = MMV_DOT_##name(w + (long long)r * row_bytes, x + (long long)t * cols, cols, lane);        \
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
        float acc = MMV_DOT_##name(w, x + (long long)(s / x_div) * cols, cols, lane);                         \
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

// Row dot products for the types the large models use, reading whole 16-byte groups of codes: Q4_K by quarter
// super-blocks (64 values: one pair of sub-blocks, whose codes share 32 bytes), Q6_K likewise (64 values from 16
// bytes of low bits twice and 16 of high bits). Each lane takes quarters lane, lane + 32, ...
__device__ __forceinline__ float mmv_dot_fast_q4_k(const u8* __restrict__ row, const float* __restrict__ xt,
                                                   int cols, int lane) {
    float acc = 0.f;
    for (int qi = lane; qi < cols / 64; qi += 32) {
        const u8* b = row + 144 * (qi >> 2);
        int j = qi & 3;
        float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc0, m0, sc1, m1;
        scale_min_k4(2 * j, b + 4, &sc0, &m0);
        scale_min_k4(2 * j + 1, b + 4, &sc1, &m1);
        const uint4* q4 = (const uint4*)(b + 16 + 32 * j);
        uint4 qa = q4[0], qb = q4[1];
        u32 words[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const float4* xa = (const float4*)(xt + 256 * (qi >> 2) + 64 * j);
        const float4* xb = xa + 8;
        float s0 = 0.f, s1 = 0.f, sx0 = 0.f, sx1 = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            float4 a = xa[w], c = xb[w];
            u32 q = words[w];
            s0 += (float)(q & 0xF) * a.x + (float)((q >> 8) & 0xF) * a.y + (float)((q >> 16) & 0xF) * a.z +
                  (float)((q >> 24) & 0xF) * a.w;
            s1 += (float)((q >> 4) & 0xF) * c.x + (float)((q >> 12) & 0xF) * c.y + (float)((q >> 20) & 0xF) * c.z +
                  (float)(q >> 28) * c.w;
            sx0 += a.x + a.y + a.z + a.w;
            sx1 += c.x + c.y + c.z + c.w;
        }
        acc += d * sc0 * s0 - dmin * m0 * sx0 + d * sc1 * s1 - dmin * m1 * sx1;
    }
    return warp_sum(acc);
}

__device__ __forceinline__ float mmv_dot_fast_q6_k(const u8* __restrict__ row, const float* __restrict__ xt,
                                                   int cols, int lane) {
    float acc = 0.f;
    for (int qi = lane; qi < cols / 64; qi += 32) {
        const u8* b = row + 210 * (qi >> 2);
        int n = (qi >> 1) & 1, lg = qi & 1;
        float d = h2f(ld16(b + 208));
        const u8* ql = b + 64 * n + 16 * lg;
        const u8* qh = b + 128 + 32 * n + 16 * lg;
        const i8* sc = (const i8*)(b + 192) + 8 * n + lg;
        const float* x = xt + 256 * (qi >> 2) + 128 * n + 16 * lg;
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            int lo = ql[l], lo2 = ql[l + 32], h = qh[l];
            s[0] += (float)((int)((lo & 0xF) | ((h & 3) << 4)) - 32) * x[l];
            s[1] += (float)((int)((lo2 & 0xF) | (((h >> 2) & 3) << 4)) - 32) * x[l + 32];
            s[2] += (float)((int)((lo >> 4) | (((h >> 4) & 3) << 4)) - 32) * x[l + 64];
            s[3] += (float)((int)((lo2 >> 4) | (((h >> 6) & 3) << 4)) - 32) * x[l + 96];
        }
        acc += d * ((float)sc[0] * s[0] + (float)sc[2] * s[1] + (float)sc[4] * s[2] + (float)sc[6] * s[3]);
    }
    return warp_sum(acc);
}

// Which row dot each type's kernels use: the fast ones above, else the generic 32-value chunk loop.
#define MMV_DOT_f32 mmv_dot32_f32
#define MMV_DOT_f16 mmv_dot32_f16
#define MMV_DOT_bf16 mmv_dot32_bf16
#define MMV_DOT_q4_0 mmv_dot32_q4_0
#define MMV_DOT_q4_1 mmv_dot32_q4_1
#define MMV_DOT_q5_0 mmv_dot32_q5_0
#define MMV_DOT_q5_1 mmv_dot32_q5_1
#define MMV_DOT_q8_0 mmv_dot32_q8_0
#define MMV_DOT_q2_k mmv_dot32_q2_k
#define MMV_DOT_q3_k mmv_dot32_q3_k
#define MMV_DOT_q4_k mmv_dot_fast_q4_k
#define MMV_DOT_q5_k mmv_dot32_q5_k
#define MMV_DOT_q6_k mmv_dot_fast_q6_k

STRATA_FOR_EACH_QTYPE(STRATA_MMV)

// f32 -> f16 bits, n values (the GEMM's activations).
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}
