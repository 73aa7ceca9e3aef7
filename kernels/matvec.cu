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
// The block's activation row, copied once into shared memory when it fits (its 8 warps all read it, a row
// each): returns where to read it. Every thread of the block must call it (it synchronises).
#define MMV_X_MAX 8192
__device__ __forceinline__ const float* mmv_stage_x(const float* __restrict__ xt, int cols) {
    __shared__ float4 xs[MMV_X_MAX / 4];
    if (cols > MMV_X_MAX) return xt;
    for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) xs[i] = ((const float4*)xt)[i];
    __syncthreads();
    return (const float*)xs;
}

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
        const float* xt = mmv_stage_x(x + (long long)t * cols, cols);                                          \
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
        float acc = MMV_DOT_##name(w + (long long)r * row_bytes, xt, cols, lane);                             \
        if (lane == 0) y[(long long)t * rows + r] = acc;                                                      \
    }                                                                                                         \
    extern "C" __global__ void mmv_moe_##name(const u8* __restrict__ wa, const u8* __restrict__ wb,          \
                                              const float* __restrict__ x, float* __restrict__ ya,           \
                                              float* __restrict__ yb, const u32* __restrict__ ids, int x_div, \
                                              int rows, int cols, long long row_bytes) {                      \
        int r = blockIdx.x * 8 + (threadIdx.x >> 5);                                                         \
        int lane = threadIdx.x & 31, s = blockIdx.y;                                                          \
        const float* xt = mmv_stage_x(x + (long long)(s / x_div) * cols, cols);                                \
        if (r >= rows) return;                                                                                \
        const u8* w = (blockIdx.z ? wb : wa) + ((long long)ids[s] * rows + r) * row_bytes;                    \
        float acc = MMV_DOT_##name(w, xt, cols, lane);                                                        \
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

// Row dot products for the types the large models use, one super-block (256 values) per warp step with lanes
// on consecutive bytes of codes, so both the codes and the activations are read coalesced (lane l takes 4 code
// bytes and the two groups of 4 activations they multiply). Q4_K: code byte i of a super-block holds value
// 64 (i / 32) + i % 32 in its low nibble and that + 32 in its high nibble. Q6_K: low-bit byte i of half n holds
// part 0 / 1 (i < 32 / i >= 32) in its low nibble and part 2 / 3 in its high nibble, high bits in qh.
__device__ __forceinline__ float mmv_dot_fast_q4_k(const u8* __restrict__ row, const float* __restrict__ xt,
                                                   int cols, int lane) {
    float acc = 0.f;
    int j = lane >> 3, o = 4 * (lane & 7);
    for (int sb = 0; sb < cols / 256; ++sb) {
        const u8* b = row + 144 * sb;
        float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc0, m0, sc1, m1;
        scale_min_k4(2 * j, b + 4, &sc0, &m0);
        scale_min_k4(2 * j + 1, b + 4, &sc1, &m1);
        u32 q = *(const u32*)(b + 16 + 32 * j + o);
        const float* x = xt + 256 * sb + 64 * j + o;
        float4 a = *(const float4*)x, c = *(const float4*)(x + 32);
        float s0 = (float)(q & 0xF) * a.x + (float)((q >> 8) & 0xF) * a.y + (float)((q >> 16) & 0xF) * a.z +
                   (float)((q >> 24) & 0xF) * a.w;
        float s1 = (float)((q >> 4) & 0xF) * c.x + (float)((q >> 12) & 0xF) * c.y + (float)((q >> 20) & 0xF) * c.z +
                   (float)(q >> 28) * c.w;
        acc += d * sc0 * s0 - dmin * m0 * (a.x + a.y + a.z + a.w) + d * sc1 * s1 - dmin * m1 * (c.x + c.y + c.z + c.w);
    }
    return warp_sum(acc);
}

__device__ __forceinline__ float mmv_dot_fast_q6_k(const u8* __restrict__ row, const float* __restrict__ xt,
                                                   int cols, int lane) {
    float acc = 0.f;
    int n = lane >> 4, bi = 4 * (lane & 15); // half, byte of ql within the half (0..63)
    int part = bi >> 5, l = bi & 31;          // part 0/1 of the low nibbles; position within the 32
    for (int sb = 0; sb < cols / 256; ++sb) {
        const u8* b = row + 210 * sb;
        float d = h2f(ld16(b + 208));
        const u8* ql = b + 64 * n + bi;
        const u8* qh = b + 128 + 32 * n + l;
        const i8* sc = (const i8*)(b + 192) + 8 * n + (l >> 4);
        const float* x = xt + 256 * sb + 128 * n + 32 * part + l;
        float4 a = *(const float4*)x, c = *(const float4*)(x + 64);
        float xa[4] = {a.x, a.y, a.z, a.w}, xc[4] = {c.x, c.y, c.z, c.w};
        float lo = 0.f, hi = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int bl = ql[i], h = qh[i];
            lo += (float)((int)((bl & 0xF) | (((h >> (2 * part)) & 3) << 4)) - 32) * xa[i];
            hi += (float)((int)((bl >> 4) | (((h >> (2 * part + 4)) & 3) << 4)) - 32) * xc[i];
        }
        acc += d * ((float)sc[2 * part] * lo + (float)sc[2 * part + 4] * hi);
    }
    return warp_sum(acc);
}

// f32 and f16 rows: lanes on consecutive 16-byte (8-byte) groups of the row and of x.
__device__ __forceinline__ float mmv_dot_fast_f32(const u8* __restrict__ row, const float* __restrict__ xt,
                                                  int cols, int lane) {
    const float4* w4 = (const float4*)row;
    const float4* x4 = (const float4*)xt;
    float acc = 0.f;
    for (int i = lane; i < cols / 4; i += 32) {
        float4 a = w4[i], b = x4[i];
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    return warp_sum(acc);
}
__device__ __forceinline__ float mmv_dot_fast_f16(const u8* __restrict__ row, const float* __restrict__ xt,
                                                  int cols, int lane) {
    const uint2* w2 = (const uint2*)row;
    const float4* x4 = (const float4*)xt;
    float acc = 0.f;
    for (int i = lane; i < cols / 4; i += 32) {
        uint2 a = w2[i];
        float4 b = x4[i];
        acc += h2f((u16)(a.x & 0xFFFF)) * b.x + h2f((u16)(a.x >> 16)) * b.y + h2f((u16)(a.y & 0xFFFF)) * b.z +
               h2f((u16)(a.y >> 16)) * b.w;
    }
    return warp_sum(acc);
}

// Which row dot each type's kernels use: the fast ones above, else the generic 32-value chunk loop.
#define MMV_DOT_f32 mmv_dot_fast_f32
#define MMV_DOT_f16 mmv_dot_fast_f16
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

#define STRATA_MMV_OF(name, dq) STRATA_MMV(name, DQ_FAST_##name)
STRATA_FOR_EACH_QTYPE(STRATA_MMV_OF)

// f32 -> f16 bits, n values (the GEMM's activations).
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}
