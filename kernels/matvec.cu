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
#define MMV_X_MAX 4096
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
        const float* xt = x + (long long)t * cols;                                                            \
        if (MMV_STAGE_##name) xt = mmv_stage_x(xt, cols);                                                     \
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
        const float* xt = x + (long long)(s / x_div) * cols;                                                  \
        if (MMV_STAGE_##name) xt = mmv_stage_x(xt, cols);                                                     \
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

// Row dot products for the types the large models use, with every load of a row in flight at once (a decode
// step is bound by how many bytes are in flight, not by arithmetic): eight lanes per super-block, four
// super-blocks per warp step, and the steps of up to 16 super-blocks (4096 values) unrolled so their loads are
// issued before any is used. Activations are read from global memory (L1 serves the block's warps), so these
// types skip the shared-memory staging and its barrier (MMV_STAGE_T 0).
//
// Q4_K, lane l: super-block 4 u + l / 8 of the step, its 16 code bytes at 16 (l % 8) (one 16-byte load). Code
// byte i of a super-block holds value 64 (i / 32) + i % 32 in its low nibble and that + 32 in its high nibble,
// so the lane's bytes give 16 consecutive values of sub-block 2 j and 16 of sub-block 2 j + 1 (j = l % 8 / 2).
__device__ __forceinline__ float q4k_lane(uint4 q, u32 dm, const u8* __restrict__ b, const float* __restrict__ x,
                                          int j) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * j, b + 4, &sc0, &m0);
    scale_min_k4(2 * j + 1, b + 4, &sc1, &m1);
    u32 w[4] = {q.x, q.y, q.z, q.w};
    float lo = 0.f, hi = 0.f, xl = 0.f, xh = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float4 a = *(const float4*)(x + 4 * i), c = *(const float4*)(x + 32 + 4 * i);
        u32 v = w[i];
        lo += (float)(v & 0xF) * a.x + (float)((v >> 8) & 0xF) * a.y + (float)((v >> 16) & 0xF) * a.z +
              (float)((v >> 24) & 0xF) * a.w;
        hi += (float)((v >> 4) & 0xF) * c.x + (float)((v >> 12) & 0xF) * c.y + (float)((v >> 20) & 0xF) * c.z +
              (float)(v >> 28) * c.w;
        xl += (a.x + a.y) + (a.z + a.w);
        xh += (c.x + c.y) + (c.z + c.w);
    }
    float d = h2f((u16)(dm & 0xFFFF)), dmin = h2f((u16)(dm >> 16));
    return d * (sc0 * lo + sc1 * hi) - dmin * (m0 * xl + m1 * xh);
}
__device__ __forceinline__ float mmv_dot_fast_q4_k(const u8* __restrict__ row, const float* __restrict__ xt,
                                                   int cols, int lane) {
    int nsb = cols / 256, p = lane & 7, j = p >> 1, o = 16 * (p & 1);
    float acc = 0.f;
    for (int sb0 = lane >> 3; sb0 < nsb; sb0 += 16) {
        uint4 q[4];
        u32 dm[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int sb = sb0 + 4 * u;
            if (sb < nsb) {
                const u8* b = row + 144 * sb;
                dm[u] = *(const u32*)b;
                q[u] = ((const uint4*)(b + 16))[p];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int sb = sb0 + 4 * u;
            if (sb < nsb) acc += q4k_lane(q[u], dm[u], row + 144 * sb, xt + 256 * sb + 64 * j + o, j);
        }
    }
    return warp_sum(acc);
}

// Q6_K, lane l: super-block 4 u + l / 8 of the step, half n = l % 8 / 4, cells l0 .. l0 + 7 (l0 = 8 (l % 4)) of
// all four parts: low-bit bytes 64 n + l0 (parts 0 / 2 in the low / high nibble) and 64 n + 32 + l0 (parts 1 / 3),
// high-bit bytes 128 + 32 n + l0 (two bits per part), scales 192 + 8 n + 2 part + l0 / 16. Super-blocks are 210
// bytes, so only 2-byte alignment holds: 8 bytes come as four 2-byte loads.
__device__ __forceinline__ uint2 ld8_a2(const u8* p) {
    const u16* h = (const u16*)p;
    return make_uint2((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16));
}
__device__ __forceinline__ float q6k_lane(uint2 l0, uint2 l1, uint2 qh, const u8* __restrict__ sc,
                                          const float* __restrict__ x) {
    u32 lw[2][2] = {{l0.x, l0.y}, {l1.x, l1.y}}, hw[2] = {qh.x, qh.y};
    float acc = 0.f;
#pragma unroll
    for (int part = 0; part < 4; ++part) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            float4 a = *(const float4*)(x + 32 * part + 4 * w);
            float xa[4] = {a.x, a.y, a.z, a.w};
            u32 lo = lw[part & 1][w] >> (4 * (part >> 1)), hb = hw[w] >> (2 * part);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                int q = (int)(((lo >> (8 * k)) & 0xF) | (((hb >> (8 * k)) & 3) << 4)) - 32;
                s += (float)q * xa[k];
            }
        }
        acc += (float)(i8)sc[2 * part] * s;
    }
    return acc;
}
__device__ __forceinline__ float mmv_dot_fast_q6_k(const u8* __restrict__ row, const float* __restrict__ xt,
                                                   int cols, int lane) {
    int nsb = cols / 256, p = lane & 7, n = p >> 2, c0 = 8 * (p & 3);
    float acc = 0.f;
    for (int sb0 = lane >> 3; sb0 < nsb; sb0 += 16) {
        uint2 l0[4], l1[4], qh[4];
        u16 d[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int sb = sb0 + 4 * u;
            if (sb < nsb) {
                const u8* b = row + 210 * sb;
                l0[u] = ld8_a2(b + 64 * n + c0);
                l1[u] = ld8_a2(b + 64 * n + 32 + c0);
                qh[u] = ld8_a2(b + 128 + 32 * n + c0);
                d[u] = *(const u16*)(b + 208);
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int sb = sb0 + 4 * u;
            if (sb < nsb) {
                const u8* b = row + 210 * sb;
                acc += h2f(d[u]) * q6k_lane(l0[u], l1[u], qh[u], b + 192 + 8 * n + (c0 >> 4),
                                            xt + 256 * sb + 128 * n + c0);
            }
        }
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

// Whether a type's kernels stage the activation row in shared memory (the fast K-quant dots read it directly).
#define MMV_STAGE_q4_k 0
#define MMV_STAGE_q6_k 0
#define MMV_STAGE_f32 1
#define MMV_STAGE_f16 1
#define MMV_STAGE_bf16 1
#define MMV_STAGE_q4_0 1
#define MMV_STAGE_q4_1 1
#define MMV_STAGE_q5_0 1
#define MMV_STAGE_q5_1 1
#define MMV_STAGE_q8_0 1
#define MMV_STAGE_q2_k 1
#define MMV_STAGE_q3_k 1
#define MMV_STAGE_q5_k 1

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

// y[t][r] = W[r] . x[t] for an f32 matrix of few rows (a MoE router: 128 rows of 2048): one block of 256 per row
// and token, its eight warps splitting the row, so the matrix is read by as many SMs as it has rows instead of by
// rows / 8. Grid (rows, n_tok), block 256.
extern "C" __global__ void mmv_wide_f32(const float* __restrict__ w, const float* __restrict__ x,
                                        float* __restrict__ y, int rows, int cols) {
    __shared__ float part[8];
    int r = blockIdx.x, t = blockIdx.y;
    const float4* w4 = (const float4*)(w + (long long)r * cols);
    const float4* x4 = (const float4*)(x + (long long)t * cols);
    float acc = 0.f;
    for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
        float4 a = w4[i], b = x4[i];
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int i = 0; i < 8; ++i) s += part[i];
        y[(long long)t * rows + r] = s;
    }
}
