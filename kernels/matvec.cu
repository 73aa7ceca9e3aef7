// Quantized matrix-vector products, embedding lookup and dequantization to f16, one kernel of each per type.
//
// A row's dot product (mmv_dot_T) is one warp's: lane l takes the 32-value chunks l, l+32, ... of the row, so a
// warp reads a row once per token; Q4_K and Q6_K have kernels of their own (MmvQ4K, MmvQ6K below: four rows per
// warp, or one in mmv1_T), whose activations are quantized to Q8_K in shared memory as the CPU quantizes them
// (integer dot products, dp4a); the other types' activations stay f32 (the CPU quantizes them to int8 first: the two
// differ by that rounding only).
//
// mmv_T: y_m[t][r] = sum_c W_m[r][c] * x[t][c] for up to three matrices m of one type and width that read the
// same activations (a layer's q/k/v, or gate/up): their rows are numbered one after another, r0 + r1 + r2 in
// all; a matrix of 0 rows is absent. Grid (ceil((r0 + r1 + r2) / rows per block), n_tok), block 256 (8 warps of
// one row each; of MMV_R rows for mmv_q4_k and mmv_q6_k).
//
// mmv_moe_T: the experts of a MoE layer at decode. Slot s (token s / x_div's i-th expert) multiplies the rows of
// expert ids[s], which start ids[s] * expert_stride bytes into wa (and wb when blockIdx.z is 1: gate and up in one
// launch: the stacked tensor, stride rows * row_bytes, or the expert cache's slots), by activation
// row s / x_div: ya[s][r]; a slot whose id is MOE_SKIP computes nothing. Grid (ceil(rows / rows per block),
// n_slots, 1 or 2), block 256. With xu given (Q4_K and Q6_K rows of at most MMV_X_MAX values; other types ignore it,
// and the host fuses it for Q4_K alone) the activation row is glu_act(x, act) * xu (the GLU fused).
// With ids_early (Q4_K and Q6_K; the ids were written by a kernel at least two launches back, so they are in memory
// once this grid starts: see pdl_enter) the first weight loads go out before the wait on the kernel just before.
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
    MMV_HOOKS_##name                                                                                          \
    extern "C" __global__ void mmv_##name(const u8* __restrict__ w0, const u8* __restrict__ w1,              \
                                          const u8* __restrict__ w2, const float* __restrict__ x,            \
                                          float* __restrict__ y0, float* __restrict__ y1,                    \
                                          float* __restrict__ y2, int r0, int r1, int r2, int cols,          \
                                          long long row_bytes) {                                              \
        int r = blockIdx.x * 8 + (threadIdx.x >> 5);                                                         \
        int lane = threadIdx.x & 31, t = blockIdx.y;                                                          \
        const u8* w = nullptr;                                                                                \
        float* y = nullptr;                                                                                   \
        int rows = 0;                                                                                         \
        if (r < r0) {                                                                                         \
            w = w0, y = y0, rows = r0;                                                                        \
        } else if ((r -= r0) < r1) {                                                                          \
            w = w1, y = y1, rows = r1;                                                                        \
        } else if ((r -= r1) < r2) {                                                                          \
            w = w2, y = y2, rows = r2;                                                                        \
        }                                                                                                     \
        if (w) w += (long long)r * row_bytes;                                                                 \
        MmvPre_##name pre;                                                                                    \
        if (w) mmv_load_##name(pre, w, cols, lane);                                                           \
        pdl_enter();                                                                                          \
        bool perm;                                                                                            \
        const float* xt = mmv_stage_##name(x + (long long)t * cols, cols, &perm);                             \
        if (!w) return;                                                                                       \
        float acc = mmv_dot_##name(pre, w, xt, perm, cols, lane);                                             \
        if (lane == 0) y[(long long)t * rows + r] = acc;                                                      \
    }                                                                                                         \
    extern "C" __global__ void mmv_moe_##name(const u8* __restrict__ wa, const u8* __restrict__ wb,          \
                                              const float* __restrict__ x, float* __restrict__ ya,           \
                                              float* __restrict__ yb, const u32* __restrict__ ids, int x_div, \
                                              int rows, int cols, long long row_bytes,                        \
                                              long long expert_stride, const float* __restrict__, int, int) { \
        int r = blockIdx.x * 8 + (threadIdx.x >> 5);                                                         \
        int lane = threadIdx.x & 31, s = blockIdx.y;                                                          \
        pdl_enter();                                                                                          \
        if (ids[s] == MOE_SKIP) return;                                                                       \
        const u8* w = r < rows ? (blockIdx.z ? wb : wa) + (long long)ids[s] * expert_stride + (long long)r * row_bytes : nullptr; \
        MmvPre_##name pre;                                                                                    \
        if (w) mmv_load_##name(pre, w, cols, lane);                                                           \
        bool perm;                                                                                            \
        const float* xt = mmv_stage_##name(x + (long long)(s / x_div) * cols, cols, &perm);                   \
        if (!w) return;                                                                                       \
        float acc = mmv_dot_##name(pre, w, xt, perm, cols, lane);                                             \
        if (lane == 0) (blockIdx.z ? yb : ya)[(long long)s * rows + r] = acc;                                 \
    }

// Embedding rows and f16 dequantization, for every type.
#define STRATA_ROWS(name, dq)                                                                                  \
    extern "C" __global__ void get_rows_##name(const u8* __restrict__ w, const u32* __restrict__ ids,         \
                                               float* __restrict__ out, int n, int cols, long long row_bytes) { \
        pdl_enter();                                                                                          \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        int per_row = cols / 32;                                                                              \
        if (i >= (long long)n * per_row) return;                                                              \
        int t = (int)(i / per_row), c = (int)(i % per_row);                                                   \
        dq(w + (long long)ids[t] * row_bytes, c, out + (long long)t * cols + 32 * c);                         \
    }                                                                                                         \
    extern "C" __global__ void dq_f16_##name(const u8* __restrict__ w, u16* __restrict__ out, int rows,       \
                                             int cols, long long row_bytes) {                                 \
        pdl_enter();                                                                                          \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        int per_row = cols / 32;                                                                              \
        if (i >= (long long)rows * per_row) return;                                                           \
        int r = (int)(i / per_row), c = (int)(i % per_row);                                                   \
        float v[32];                                                                                          \
        dq(w + (long long)r * row_bytes, c, v);                                                               \
        uint4* o = (uint4*)(out + (long long)r * cols + 32 * c); /* 64-byte aligned: cols % 32 == 0 */        \
        for (int l = 0; l < 4; ++l)                                                                           \
            o[l] = make_uint4(pack_h2(f2h(v[8 * l]), f2h(v[8 * l + 1])), pack_h2(f2h(v[8 * l + 2]), f2h(v[8 * l + 3])), \
                              pack_h2(f2h(v[8 * l + 4]), f2h(v[8 * l + 5])), pack_h2(f2h(v[8 * l + 6]), f2h(v[8 * l + 7]))); \
    }

// Matrix-vector products for the types the large models use (Q4_K, Q6_K), built so that a decode step keeps
// enough bytes in flight to approach the memory's rate: a warp computes MMV_R rows at once, eight lanes per
// super-block and four super-blocks per warp step, so each batch of 8 super-blocks (2048 values) issues
// 2 MMV_R loads per lane before any is used, and the first batch is issued before the block's barrier. The
// activation row is staged in shared memory once per block (8 MMV_R rows) as Q8_K codes (Q8kStage); rows longer
// than MMV_X_MAX take f32 activations from global memory in natural order (perm false; the permuted f32 staging is
// kept for a type without a Q8_K dot). Grid (ceil(rows / (8 MMV_R)), ...), block 256.
#define MMV_R 4

// A small unsigned integer (< 2^23) as a float without the quarter-rate integer conversion: its bits under the
// exponent of 2^23, minus 2^23 (exact).
__device__ __forceinline__ float small_u2f(u32 v) { return __int_as_float(0x4B000000u | v) - 8388608.f; }

// Four int8 products summed into c (PTX dp4a, sm_61 and later).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The activation row quantized as the CPU quantizes it for K-quant weights (ggml's Q8_K, cpu: quant/activations.rs):
// per 256 values d = amax / 127 and codes round-to-nearest-even of x * (127 / amax), the codes' sums per 16 values;
// amax < 1e-30 gives d = 0 and codes 0, a NaN or infinite value d = NaN and codes 0. Codes are stored in the Q4_K
// lanes' order: 16-byte slot (sb * 2 + hl) * 8 + p holds values 256 sb + 64 (p / 2) + 16 (p % 2) + 32 hl + 0..15,
// so the eight lanes of a super-block read 128 consecutive bytes. Integer products then replace the float ones:
// a quarter of the shared-memory bytes and a dp4a per four values.
// The other layout (Q6_K's lanes, NATURAL): values in order, 16 bytes of padding after every 128 (so the eight
// lanes of a super-block, 128 values apart in two groups of four, meet fewer bank conflicts): value v's code at byte
// q8k_natural(v).
struct Q8kStage {
    u32 codes[MMV_X_MAX / 4 + MMV_X_MAX / 32];
    short bsum[MMV_X_MAX / 16];
    float d[MMV_X_MAX / 256];
};
__device__ __forceinline__ int q8k_natural(int v) { return v + 16 * (v >> 7); }
// Super-block sb of x (or of glu_act(x) * xu) into st: one warp's work (every lane of it calls it).
template <bool NATURAL>
__device__ __forceinline__ void stage_q8k_sb(const float* __restrict__ x, const float* __restrict__ xu, int act, int sb,
                                             Q8kStage& st) {
    int lane = threadIdx.x & 31;
    const float4* x4 = (const float4*)(x + 256 * sb + 8 * lane);
    float4 a = x4[0], b = x4[1];
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    if (xu) {
        const float4* u4 = (const float4*)(xu + 256 * sb + 8 * lane);
        float4 c = u4[0], e = u4[1];
        float u[8] = {c.x, c.y, c.z, c.w, e.x, e.y, e.z, e.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = glu_act(v[k], act) * u[k];
    }
    float am = 0.f;
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        bad |= !(fabsf(v[k]) <= 3.402823466e38f);
        am = fmaxf(am, fabsf(v[k]));
    }
    am = warp_max(am);
    bad = __any_sync(0xffffffffu, bad);
    float d = 0.f, is = 0.f;
    if (bad) {
        d = __int_as_float(0x7fc00000);
    } else if (am >= 1e-30f) {
        d = am / 127.f;
        is = 127.f / am;
    }
    u32 w[2] = {0, 0};
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int q = __float2int_rn(v[k] * is);
        sum += q;
        w[k >> 2] |= (u32)(q & 0xFF) << (8 * (k & 3));
    }
    // Values 8 lane .. 8 lane + 7: run hl = lane / 4 % 2, lane p = 2 (lane / 8) + lane / 2 % 2, bytes 8 (lane % 2)..
    int at = NATURAL ? q8k_natural(256 * sb + 8 * lane) / 4
                     : ((sb * 2 + ((lane >> 2) & 1)) * 8 + 2 * (lane >> 3) + ((lane >> 1) & 1)) * 4 + 2 * (lane & 1);
    st.codes[at] = w[0];
    st.codes[at + 1] = w[1];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!(lane & 1)) st.bsum[sb * 16 + (lane >> 1)] = (short)sum;
    if (lane == 0) st.d[sb] = d;
}

// Fills st from x (cols <= MMV_X_MAX, a multiple of 256), or from glu_act(x) * xu when xu is given (the GLU of a
// MoE down projection, fused), in the Q4_K lanes' order or (NATURAL) Q6_K's; every thread of the block calls it (it
// synchronises).
template <bool NATURAL>
__device__ __forceinline__ void stage_q8k(const float* __restrict__ x, const float* __restrict__ xu, int act, int cols,
                                          Q8kStage& st) {
    for (int sb = threadIdx.x >> 5; sb < cols / 256; sb += blockDim.x >> 5) stage_q8k_sb<NATURAL>(x, xu, act, sb, st);
    __syncthreads();
}

// Q4_K, lane l: super-block 4 u + l / 8 of the batch, its 16 code bytes at 16 (l % 8) (one 16-byte load). Code
// byte i of a super-block holds value 64 (i / 32) + i % 32 in its low nibble and that + 32 in its high nibble,
// so the lane's bytes give 16 consecutive values of sub-block 2 j and 16 of sub-block 2 j + 1 (j = l % 8 / 2).
// Staged float4 slot ((sb * 2 + hl) * 4 + i) * 8 + p holds values 256 sb + 64 (p / 2) + 16 (p % 2) + 32 hl + 4 i.
struct MmvQ4K {
    struct Part {
        uint4 q;
        u32 h; // word p % 4 of the head {d, dmin, scales[12]}: the group's lanes 0-3 hold it all (head_word)
    };
    static constexpr int SB_BYTES = 144;
    // Word k of the super-block head, from lane k of the lane's group of eight (every lane of the group calls it
    // with the same k): one 4-byte load per lane instead of a byte load per scale.
    static __device__ __forceinline__ u32 head_word(const Part& f, int k) {
        int lane = threadIdx.x & 31;
        return __shfl_sync(0xFFu << (lane & 24), f.h, (lane & 24) | k);
    }
    static constexpr bool Q8 = true, NATURAL = false;
    // The lane's two sub-blocks' 6-bit scales and mins and the super-block's d and dmin (what dot_q8 needs of the
    // weights besides the codes: decoded once for all the activation rows a loaded part meets).
    struct Scales {
        int sc0, sc1, m0, m1;
        float d, dmin;
    };
    static __device__ __forceinline__ Scales scales(const Part& f, const u8* __restrict__ b, int p) {
        int j = p >> 1;
        // Sub-blocks 2 j and 2 j + 1's 6-bit scales and mins (scale_min_k4), four bytes at a time: scales[0..4)
        // are w1, [4..8) w2, [8..12) w3.
        u32 w0 = head_word(f, 0), w1 = head_word(f, 1), w2 = head_word(f, 2), w3 = head_word(f, 3), scw, mw;
        if (j < 2) {
            scw = w1 & 0x3F3F3F3Fu;
            mw = w2 & 0x3F3F3F3Fu;
        } else {
            scw = (w3 & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
            mw = ((w3 >> 4) & 0x0F0F0F0Fu) | ((w2 >> 2) & 0x30303030u);
        }
        int at = 16 * (j & 1);
        return {(int)((scw >> at) & 0xFF), (int)((scw >> (at + 8)) & 0xFF), (int)((mw >> at) & 0xFF),
                (int)((mw >> (at + 8)) & 0xFF), h2f((u16)(w0 & 0xFFFF)), h2f((u16)(w0 >> 16))};
    }
    // The lane's 32 values against Q8_K activations: integer sums per sub-block, the scales and mins after.
    static __device__ __forceinline__ float dot_q8(const Part& f, const u8* __restrict__ b, const Q8kStage& st, int sb,
                                                   int p) {
        return dot_q8s(f, scales(f, b, p), st, sb, p);
    }
    // The part's 32 codes as bytes: low nibbles (sub-block 2 j) and high (2 j + 1), unpacked once for all the
    // activation rows a loaded part meets.
    struct Codes {
        int lo[4], hi[4];
    };
    static __device__ __forceinline__ Codes codes(const Part& f) {
        u32 q[4] = {f.q.x, f.q.y, f.q.z, f.q.w};
        Codes c;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            c.lo[i] = (int)(q[i] & 0x0F0F0F0Fu);
            c.hi[i] = (int)((q[i] >> 4) & 0x0F0F0F0Fu);
        }
        return c;
    }
    static __device__ __forceinline__ float dot_q8s(const Part& f, const Scales& k, const Q8kStage& st, int sb, int p) {
        return dot_q8c(codes(f), k, st, sb, p);
    }
    static __device__ __forceinline__ float dot_q8c(const Codes& c, const Scales& k, const Q8kStage& st, int sb, int p) {
        int j = p >> 1, h = p & 1;
        const uint4* c4 = (const uint4*)st.codes;
        uint4 xl = c4[(sb * 2) * 8 + p], xh = c4[(sb * 2 + 1) * 8 + p];
        int sl = 0, sh = 0;
        sl = dp4a(c.lo[0], (int)xl.x, sl);
        sl = dp4a(c.lo[1], (int)xl.y, sl);
        sl = dp4a(c.lo[2], (int)xl.z, sl);
        sl = dp4a(c.lo[3], (int)xl.w, sl);
        sh = dp4a(c.hi[0], (int)xh.x, sh);
        sh = dp4a(c.hi[1], (int)xh.y, sh);
        sh = dp4a(c.hi[2], (int)xh.z, sh);
        sh = dp4a(c.hi[3], (int)xh.w, sh);
        int bl = st.bsum[sb * 16 + 4 * j + h], bh = st.bsum[sb * 16 + 4 * j + 2 + h];
        return st.d[sb] * (k.d * (float)(k.sc0 * sl + k.sc1 * sh) - k.dmin * (float)(k.m0 * bl + k.m1 * bh));
    }
    static __device__ __forceinline__ int x4(int sb, int p, int hl, int i, bool perm) {
        return perm ? ((sb * 2 + hl) * 4 + i) * 8 + p
                    : (256 * sb + 64 * (p >> 1) + 16 * (p & 1) + 32 * hl + 4 * i) >> 2;
    }
    static __device__ __forceinline__ int slot_src(int t) { return x4(t >> 6, t & 7, (t >> 5) & 1, (t >> 3) & 3, false); }
    static __device__ __forceinline__ void load(Part& f, const u8* __restrict__ b, int p) {
        f.h = ((const u32*)b)[p & 3];
        f.q = ((const uint4*)(b + 16))[p];
    }
    static __device__ __forceinline__ float dot(const Part& f, const u8* __restrict__ b, const float4* __restrict__ xs,
                                                int sb, int p, bool perm) {
        int j = p >> 1, sc0, m0, sc1, m1;
        scale_min_k4(2 * j, b + 4, &sc0, &m0);
        scale_min_k4(2 * j + 1, b + 4, &sc1, &m1);
        u32 w[4] = {f.q.x, f.q.y, f.q.z, f.q.w};
        float lo = 0.f, hi = 0.f, xl = 0.f, xh = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float4 a = xs[x4(sb, p, 0, i, perm)], c = xs[x4(sb, p, 1, i, perm)];
            u32 v = w[i];
            lo += small_u2f(v & 0xF) * a.x + small_u2f((v >> 8) & 0xF) * a.y + small_u2f((v >> 16) & 0xF) * a.z +
                  small_u2f((v >> 24) & 0xF) * a.w;
            hi += small_u2f((v >> 4) & 0xF) * c.x + small_u2f((v >> 12) & 0xF) * c.y +
                  small_u2f((v >> 20) & 0xF) * c.z + small_u2f(v >> 28) * c.w;
            xl += (a.x + a.y) + (a.z + a.w);
            xh += (c.x + c.y) + (c.z + c.w);
        }
        u32 dm = *(const u32*)b;
        float d = h2f((u16)(dm & 0xFFFF)), dmin = h2f((u16)(dm >> 16));
        return d * (sc0 * lo + sc1 * hi) - dmin * (m0 * xl + m1 * xh);
    }
};

// Q6_K, lane l: super-block 4 u + l / 8 of the batch, half n = l % 8 / 4, cells c0 .. c0 + 7 (c0 = 8 (l % 4)) of
// all four parts: low-bit bytes 64 n + c0 (parts 0 / 2 in the low / high nibble) and 64 n + 32 + c0 (parts 1 / 3),
// high-bit bytes 128 + 32 n + c0 (two bits per part), scales 192 + 8 n + 2 part + c0 / 16. Super-blocks are 210
// bytes, so only 2-byte alignment holds: 8 bytes come as four 2-byte loads. Staged float4 slot
// ((sb * 4 + part) * 2 + w) * 8 + p holds values 256 sb + 128 (p / 4) + 32 part + 8 (p % 4) + 4 w.
__device__ __forceinline__ uint2 ld8_a2(const u8* p) {
    const u16* h = (const u16*)p;
    return make_uint2((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16));
}
struct MmvQ6K {
    struct Part {
        uint2 l0, l1, qh;
        u32 d;
    };
    static constexpr int SB_BYTES = 210;
#ifdef MMV_Q6K_F32
    static constexpr bool Q8 = false, NATURAL = true; // f32 activations (a measurement: STRATA_KERNEL_DEFINES)
#else
    static constexpr bool Q8 = true, NATURAL = true;
#endif
    // The lane's four parts' scales (bytes of the super-block's tail) and d: read once for all the activation rows
    // a loaded part meets.
    struct Scales {
        int sc[4];
        float d;
    };
    static __device__ __forceinline__ Scales scales(const Part& f, const u8* __restrict__ b, int p) {
        int n = (p >> 2) & 1, c0 = 8 * (p & 3);
        const u8* sc = b + 192 + 8 * n + (c0 >> 4);
        return {{(int)(i8)sc[0], (int)(i8)sc[2], (int)(i8)sc[4], (int)(i8)sc[6]}, h2f((u16)f.d)};
    }
    // The lane's 32 values against Q8_K activations (the CPU's vec_dot_q8 for Q6_K): per part an integer sum of
    // (q - 32) * a over its 8 values (two dp4a for q * a, two for the sum of a), times the part's scale; the scales
    // of the two weights' and the activations' super-blocks after.
    static __device__ __forceinline__ float dot_q8(const Part& f, const u8* __restrict__ b, const Q8kStage& st, int sb,
                                                   int p) {
        return dot_q8s(f, scales(f, b, p), st, sb, p);
    }
    // The part's 32 six-bit codes as bytes (q[part][w]: 4 values each), unpacked once for all the activation rows
    // a loaded part meets.
    struct Codes {
        int q[4][2];
    };
    static __device__ __forceinline__ Codes codes(const Part& f) {
        u32 lw[2][2] = {{f.l0.x, f.l0.y}, {f.l1.x, f.l1.y}}, hw[2] = {f.qh.x, f.qh.y};
        Codes c;
#pragma unroll
        for (int part = 0; part < 4; ++part)
#pragma unroll
            for (int w = 0; w < 2; ++w)
                c.q[part][w] = (int)(((lw[part & 1][w] >> (4 * (part >> 1))) & 0x0F0F0F0Fu) |
                                     (((hw[w] >> (2 * part)) & 0x03030303u) << 4));
        return c;
    }
    static __device__ __forceinline__ float dot_q8s(const Part& f, const Scales& k, const Q8kStage& st, int sb, int p) {
        return dot_q8c(codes(f), k, st, sb, p);
    }
    static __device__ __forceinline__ float dot_q8c(const Codes& c, const Scales& k, const Q8kStage& st, int sb, int p) {
        int n = (p >> 2) & 1, c0 = 8 * (p & 3);
        const uint2* c2 = (const uint2*)st.codes;
        int acc = 0;
#pragma unroll
        for (int part = 0; part < 4; ++part) {
            uint2 a = c2[q8k_natural(256 * sb + 128 * n + 32 * part + c0) >> 3];
            int s = 0, sa = 0;
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                int av = (int)(w ? a.y : a.x);
                s = dp4a(c.q[part][w], av, s);
                sa = dp4a(0x01010101, av, sa);
            }
            acc += k.sc[part] * (s - 32 * sa);
        }
        return k.d * st.d[sb] * (float)acc;
    }
    static __device__ __forceinline__ int x4(int sb, int p, int part, int w, bool perm) {
        return perm ? ((sb * 4 + part) * 2 + w) * 8 + p
                    : (256 * sb + 128 * (p >> 2) + 32 * part + 8 * (p & 3) + 4 * w) >> 2;
    }
    static __device__ __forceinline__ int slot_src(int t) { return x4(t >> 6, t & 7, (t >> 4) & 3, (t >> 3) & 1, false); }
    static __device__ __forceinline__ void load(Part& f, const u8* __restrict__ b, int p) {
        int n = (p >> 2) & 1, c0 = 8 * (p & 3);
        f.l0 = ld8_a2(b + 64 * n + c0);
        f.l1 = ld8_a2(b + 64 * n + 32 + c0);
        f.qh = ld8_a2(b + 128 + 32 * n + c0);
        f.d = *(const u16*)(b + 208);
    }
    static __device__ __forceinline__ float dot(const Part& f, const u8* __restrict__ b, const float4* __restrict__ xs,
                                                int sb, int p, bool perm) {
        int n = (p >> 2) & 1, c0 = 8 * (p & 3);
        const u8* sc = b + 192 + 8 * n + (c0 >> 4);
        u32 lw[2][2] = {{f.l0.x, f.l0.y}, {f.l1.x, f.l1.y}}, hw[2] = {f.qh.x, f.qh.y};
        float acc = 0.f;
#pragma unroll
        for (int part = 0; part < 4; ++part) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                float4 a = xs[x4(sb, p, part, w, perm)];
                float xa[4] = {a.x, a.y, a.z, a.w};
                u32 lo = lw[part & 1][w] >> (4 * (part >> 1)), hb = hw[w] >> (2 * part);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float q = small_u2f(((lo >> (8 * k)) & 0xF) | (((hb >> (8 * k)) & 3) << 4)) - 32.f;
                    s += q * xa[k];
                }
            }
            acc += (float)(i8)sc[2 * part] * s;
        }
        return h2f((u16)f.d) * acc;
    }
};

// The lane's parts (eight lanes a super-block) of super-blocks base + lane / 8 and base + lane / 8 + 4 of the rows
// w[0..R) (null: absent) into f: a warp step of mmv_fast_rows and mmvt_rows.
template <class Q, int R>
__device__ __forceinline__ void mmv_load_step(typename Q::Part (*f)[2], const u8* const* w, int base, int nsb, int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            int sb = base + (lane >> 3) + 4 * u;
            if (w[r] && sb < nsb) Q::load(f[r][u], w[r] + Q::SB_BYTES * sb, lane & 7);
        }
}

// The rows w[0..R) (null: absent) times the activation row x (global) into acc; every thread of the block calls it
// (it stages x and synchronises).
template <class Q, int R>
__device__ __forceinline__ void mmv_fast_rows(const u8* const* w, const float* __restrict__ x,
                                              const float* __restrict__ xu, int act, int cols, int lane, float* acc) {
    __shared__ float4 xs_fast[MMV_X_MAX / 4];
    int nsb = cols / 256, p = lane & 7;
    typename Q::Part f[R][2];
    mmv_load_step<Q, R>(f, w, 0, nsb, lane);
    pdl_enter(); // the weights' first loads are in flight; the activations come from the kernel before
    if constexpr (Q::Q8) {
        if (cols <= MMV_X_MAX) {
            Q8kStage& st = *(Q8kStage*)xs_fast;
            stage_q8k<Q::NATURAL>(x, xu, act, cols, st);
            for (int base = 0; base < nsb; base += 8) {
                if (base > 0) mmv_load_step<Q, R>(f, w, base, nsb, lane);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        int sb = base + (lane >> 3) + 4 * u;
                        if (w[r] && sb < nsb) acc[r] += Q::dot_q8(f[r][u], w[r] + Q::SB_BYTES * sb, st, sb, p);
                    }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
            return;
        }
    }
    bool perm = cols <= MMV_X_MAX;
    const float4* xs = (const float4*)x;
    if (perm) {
        for (int t = threadIdx.x; t < cols / 4; t += blockDim.x) xs_fast[t] = xs[Q::slot_src(t)];
        __syncthreads();
        xs = xs_fast;
    }
    for (int base = 0; base < nsb; base += 8) {
        if (base > 0) mmv_load_step<Q, R>(f, w, base, nsb, lane);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                int sb = base + (lane >> 3) + 4 * u;
                if (w[r] && sb < nsb) acc[r] += Q::dot(f[r][u], w[r] + Q::SB_BYTES * sb, xs, sb, p, perm);
            }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

// The MoE experts' rows by lane groups (Q8_K activations staged, cols <= MMV_X_MAX) for up to T activation rows
// at once: lane group g = lane / 8 of a warp computes rows first + 4 i + g (i < RG; rows from `rows` on are absent)
// of the matrix at base, each whole, NB super-blocks per batch, so every lane loads even when a row has fewer than
// four super-blocks (an expert's down projection: 768 values, three) and a warp keeps RG * NB loads per lane in
// flight; each loaded weight part is used for the n <= T activation rows x[0..n) (with xu[t], or null: see
// stage_q8k), and each row's sum takes three shuffles. acc[i][t] gets row i's product with x[t] (every lane of the
// group), computed in the same order whatever n is, so a token's result does not depend on the others. st_group:
// the block's T stages in shared memory (the kernel's, 16-byte aligned: dot_q8c reads them as uint4 / uint2). Every
// thread of the block calls it (it stages x and synchronises).
template <class Q, int RG, int NB, int T>
__device__ __forceinline__ void mmv_group_rows(const u8* __restrict__ base, long long row_bytes, int first, int rows,
                                               const float* const* x, const float* const* xu, int n, int act,
                                               int cols, int lane, Q8kStage* st_group, float (*acc)[T]) {
    int nsb = cols / 256, p = lane & 7;
    const u8* w[RG];
#pragma unroll
    for (int i = 0; i < RG; ++i) {
        int r = first + 4 * i + (lane >> 3);
        w[i] = r < rows ? base + (long long)r * row_bytes : nullptr;
#pragma unroll
        for (int t = 0; t < T; ++t) acc[i][t] = 0.f;
    }
    typename Q::Part f[RG][NB];
#pragma unroll
    for (int i = 0; i < RG; ++i)
#pragma unroll
        for (int u = 0; u < NB; ++u)
            if (w[i] && u < nsb) Q::load(f[i][u], w[i] + Q::SB_BYTES * u, p);
    pdl_enter(); // the weights' first loads are in flight; the activations come from the kernel before
    if constexpr (T == 1) {
        stage_q8k<Q::NATURAL>(x[0], xu[0], act, cols, st_group[0]);
    } else {
        // The n rows' super-blocks spread over the block's warps, one barrier for all.
        for (int k = threadIdx.x >> 5; k < n * nsb; k += blockDim.x >> 5) {
            int t = k / nsb;
            stage_q8k_sb<Q::NATURAL>(x[t], xu[t], act, k - t * nsb, st_group[t]);
        }
        __syncthreads();
    }
    for (int b0 = 0; b0 < nsb; b0 += NB) {
        if (b0 > 0) {
#pragma unroll
            for (int i = 0; i < RG; ++i)
#pragma unroll
                for (int u = 0; u < NB; ++u)
                    if (w[i] && b0 + u < nsb) Q::load(f[i][u], w[i] + Q::SB_BYTES * (b0 + u), p);
        }
#pragma unroll
        for (int i = 0; i < RG; ++i)
#pragma unroll
            for (int u = 0; u < NB; ++u)
                if (w[i] && b0 + u < nsb) {
                    typename Q::Scales k = Q::scales(f[i][u], w[i] + Q::SB_BYTES * (b0 + u), p);
                    typename Q::Codes c = Q::codes(f[i][u]);
#pragma unroll
                    for (int t = 0; t < T; ++t)
                        if (t < n) acc[i][t] += Q::dot_q8c(c, k, st_group[t], b0 + u, p);
                }
    }
#pragma unroll
    for (int i = 0; i < RG; ++i)
#pragma unroll
        for (int t = 0; t < T; ++t)
            for (int o = 4; o > 0; o >>= 1) acc[i][t] += __shfl_xor_sync(0xffffffffu, acc[i][t], o);
}

// Rows of a MoE launch per group of eight lanes (mmv_group_rows' RG) for rows of nsb super-blocks: two when a row
// has at most four (so a launch of 2048 rows of 768 values per expert is one wave of blocks), else one. The host
// sizes the grid by it (cuda/mod.rs, mmv_moe_rows_per_block): change both together.
#define MMV_MOE_RG_SHORT 2
// Super-blocks a lane of the grouped MoE kernel (mmv_moe_group_T) loads at once for rows of more than four: 8 (a
// tuning run may set 4 through STRATA_KERNEL_DEFINES).
#ifndef MMV_MOE_NB_LONG
#define MMV_MOE_NB_LONG 8
#endif

// Minimum resident blocks per SM asked of the compiler (__launch_bounds__(256, n)) for the fast matrix-vector
// kernels (MMV_MINB: unset, no bound, the compiler's choice of registers) and the Q4_K MoE one (MMV_MOE_MINB: 3, so
// that a layer's 8 experts x 1,536 gate/up rows of the 30B-A3B shape, 384 blocks, are one wave on 132 SMs: tg128
// 410 -> 415 tok/s on the H200, reports/reference/2026-11-29-cuda-h200.md); a tuning run may set them
// (STRATA_KERNEL_DEFINES; MMV_MOE_MINB=1 is no bound).
#ifdef MMV_MINB
#define MMV_BOUNDS __launch_bounds__(256, MMV_MINB)
#else
#define MMV_BOUNDS
#endif
#ifndef MMV_MOE_MINB
#define MMV_MOE_MINB 3
#endif
#define MMV_MOE_BOUNDS __launch_bounds__(256, MMV_MOE_MINB)
#define STRATA_MMV_FAST(name, Q, pre, R)                                                                                \
    extern "C" __global__ void MMV_BOUNDS pre##name(const u8* __restrict__ w0, const u8* __restrict__ w1,                \
                                          const u8* __restrict__ w2, const float* __restrict__ x,              \
                                          float* __restrict__ y0, float* __restrict__ y1,                      \
                                          float* __restrict__ y2, int r0, int r1, int r2, int cols,            \
                                          long long row_bytes) {                                                \
        int lane = threadIdx.x & 31, t = blockIdx.y;                                                            \
        int first = (blockIdx.x * 8 + (threadIdx.x >> 5)) * R;                                             \
        const u8* w[R];                                                                                     \
        float* y[R];                                                                                        \
        float acc[R];                                                                                       \
        for (int i = 0; i < R; ++i) {                                                                       \
            int r = first + i;                                                                                  \
            acc[i] = 0.f;                                                                                       \
            w[i] = nullptr;                                                                                     \
            if (r < r0) {                                                                                       \
                w[i] = w0 + (long long)r * row_bytes, y[i] = y0 + (long long)t * r0 + r;                        \
            } else if ((r -= r0) < r1) {                                                                        \
                w[i] = w1 + (long long)r * row_bytes, y[i] = y1 + (long long)t * r1 + r;                        \
            } else if ((r -= r1) < r2) {                                                                        \
                w[i] = w2 + (long long)r * row_bytes, y[i] = y2 + (long long)t * r2 + r;                        \
            }                                                                                                   \
        }                                                                                                       \
        mmv_fast_rows<Q, R>(w, x + (long long)t * cols, nullptr, 0, cols, lane, acc);                                          \
        if (lane == 0)                                                                                          \
            for (int i = 0; i < R; ++i)                                                                     \
                if (w[i]) *y[i] = acc[i];                                                                       \
    }

#define STRATA_MMV_MOE_FAST(name, Q, R, KERNEL_BOUNDS)                                                           \
    extern "C" __global__ void KERNEL_BOUNDS mmv_moe_##name(                                                     \
                                              const u8* __restrict__ wa, const u8* __restrict__ wb,            \
                                              const float* __restrict__ x, float* __restrict__ ya,             \
                                              float* __restrict__ yb, const u32* __restrict__ ids, int x_div,   \
                                              int rows, int cols, long long row_bytes,                          \
                                              long long expert_stride, const float* __restrict__ xu, int act,   \
                                              int ids_early) {                                                  \
        int lane = threadIdx.x & 31, s = blockIdx.y;                                                            \
        if (!ids_early) pdl_enter();                                                                            \
        u32 id = ld_cg_u32(ids + s);                                                                            \
        if (id == MOE_SKIP) { pdl_enter(); return; } /* every kernel waits before its dependents launch */     \
        const u8* base = (blockIdx.z ? wb : wa) + (long long)id * expert_stride;                             \
        const float* xs = x + (long long)(s / x_div) * cols;                                                    \
        const float* xus = xu ? xu + (long long)(s / x_div) * cols : nullptr;                                   \
        float* y = (blockIdx.z ? yb : ya) + (long long)s * rows;                                                \
        /* rows per block: 32 RG for rows of at most four super-blocks, else 32 (mmv_moe_rows_per_block) */     \
        constexpr int RG = MMV_MOE_RG_SHORT;                                                                    \
        bool short_rows = cols <= 1024;                                                                         \
        int block_first = blockIdx.x * (short_rows ? 32 * RG : 32), warp = threadIdx.x >> 5;                    \
        if (Q::Q8 && cols <= MMV_X_MAX) {                                                                       \
            __shared__ __align__(16) Q8kStage st[1];                                                            \
            float acc[RG][1];                                                                                   \
            int first = block_first + warp * (short_rows ? 4 * RG : 4), g = lane >> 3;                          \
            if (short_rows)                                                                                     \
                mmv_group_rows<Q, RG, 4, 1>(base, row_bytes, first, rows, &xs, &xus, 1, act, cols, lane, st, acc); \
            else                                                                                                \
                mmv_group_rows<Q, 1, 8, 1>(base, row_bytes, first, rows, &xs, &xus, 1, act, cols, lane, st, acc); \
            for (int i = 0; i < (short_rows ? RG : 1); ++i)                                                     \
                if ((lane & 7) == 0 && first + 4 * i + g < rows) y[first + 4 * i + g] = acc[i][0];              \
            return;                                                                                             \
        }                                                                                                       \
        /* f32 activations: R rows per warp, 32 per round */                                                    \
        for (int round = 0; round < (short_rows ? RG : 1); ++round) {                                           \
            if (round > 0) __syncthreads(); /* every warp is done with the staged row before it is staged again */ \
            int first = block_first + 32 * round + warp * R;                                                    \
            const u8* w[R];                                                                                     \
            float acc[R];                                                                                       \
            for (int i = 0; i < R; ++i) {                                                                       \
                acc[i] = 0.f;                                                                                   \
                w[i] = first + i < rows ? base + (long long)(first + i) * row_bytes : nullptr;                  \
            }                                                                                                   \
            mmv_fast_rows<Q, R>(w, xs, xus, act, cols, lane, acc);                                              \
            if (lane == 0)                                                                                      \
                for (int i = 0; i < R; ++i)                                                                     \
                    if (w[i]) y[first + i] = acc[i];                                                            \
        }                                                                                                       \
    }
// mmv_moe_group_T: mmv_moe_T over groups of routing slots that share an expert (a step of several tokens), so
// each weight row is read once for up to MOE_GROUP_T slots instead of once per slot. groups (moe_groups, written on
// the device): groups[0] is the count; group g at groups + 1 + g * MOE_GROUP_INTS is (expert or cache slot id,
// slots n <= MOE_GROUP_T, the n routing slots ascending). Slot s multiplies by activation row s / x_div (times
// xu's, GLU fused, when xu is given) into ya / yb row s, as mmv_moe_T: each slot's result is that kernel's, bit
// for bit (mmv_group_rows computes every row alike whatever n is). Grid (ceil(rows / rows per block),
// most groups, 1 or 2); blocks past the count compute nothing. With groups_early (written at least two
// launches back: see pdl_enter) the table is read before the wait on the kernel just before. Q4_K and Q6_K with
// Q8_K activations and rows of at most MMV_X_MAX values (the host checks).
#define STRATA_MMV_MOE_GROUP(name, Q, KERNEL_BOUNDS)                                                            \
    extern "C" __global__ void KERNEL_BOUNDS mmv_moe_group_##name(                                              \
        const u8* __restrict__ wa, const u8* __restrict__ wb, const float* __restrict__ x, float* __restrict__ ya, \
        float* __restrict__ yb, const int* __restrict__ groups, int x_div, int rows, int cols,                 \
        long long row_bytes, long long expert_stride, const float* __restrict__ xu, int act, int groups_early) { \
        constexpr int T = MOE_GROUP_T, RG = MMV_MOE_RG_SHORT;                                                   \
        int lane = threadIdx.x & 31, g = blockIdx.y;                                                            \
        if (!groups_early) pdl_enter();                                                                         \
        if (g >= (int)ld_cg_u32((const u32*)groups)) { pdl_enter(); return; }                                 \
        const u32* gr = (const u32*)groups + 1 + g * MOE_GROUP_INTS;                                           \
        u32 id = ld_cg_u32(gr);                                                                                 \
        int n = (int)ld_cg_u32(gr + 1);                                                                         \
        const u8* base = (blockIdx.z ? wb : wa) + (long long)id * expert_stride;                             \
        const float* xs[T];                                                                                     \
        const float* xus[T];                                                                                    \
        int slot[T];                                                                                            \
        _Pragma("unroll") for (int t = 0; t < T; ++t) {                                                         \
            slot[t] = t < n ? (int)ld_cg_u32(gr + 2 + t) : 0;                                                   \
            xs[t] = x + (long long)(slot[t] / x_div) * cols;                                                    \
            xus[t] = xu ? xu + (long long)(slot[t] / x_div) * cols : nullptr;                                   \
        }                                                                                                       \
        float* y = blockIdx.z ? yb : ya;                                                                        \
        bool short_rows = cols <= 1024;                                                                         \
        int warp = threadIdx.x >> 5, q = lane >> 3;                                                             \
        int first = blockIdx.x * (short_rows ? 32 * RG : 32) + warp * (short_rows ? 4 * RG : 4);                \
        __shared__ __align__(16) Q8kStage st[T];                                                                \
        float acc[RG][T];                                                                                       \
        if (short_rows)                                                                                         \
            mmv_group_rows<Q, RG, 4, T>(base, row_bytes, first, rows, xs, xus, n, act, cols, lane, st, acc);    \
        else                                                                                                    \
            mmv_group_rows<Q, 1, MMV_MOE_NB_LONG, T>(base, row_bytes, first, rows, xs, xus, n, act, cols, lane, st, acc); \
        _Pragma("unroll") for (int i = 0; i < RG; ++i)                                                          \
            _Pragma("unroll") for (int t = 0; t < T; ++t)                                                       \
                if ((short_rows || i == 0) && t < n && (lane & 7) == 0 && first + 4 * i + q < rows)             \
                    y[(long long)slot[t] * rows + first + 4 * i + q] = acc[i][t];                               \
    }

// mmv_T: four rows per warp (large matrices: the output, the experts' stacked rows); mmv1_T: one row per warp
// (smaller dense matrices, whose rows / 32 blocks would leave SMs idle).
STRATA_MMV_FAST(q4_k, MmvQ4K, mmv_, MMV_R)
STRATA_MMV_FAST(q6_k, MmvQ6K, mmv_, MMV_R)
STRATA_MMV_FAST(q4_k, MmvQ4K, mmv1_, 1)
STRATA_MMV_FAST(q6_k, MmvQ6K, mmv1_, 1)
STRATA_MMV_MOE_FAST(q4_k, MmvQ4K, MMV_R, MMV_MOE_BOUNDS)
STRATA_MMV_MOE_FAST(q6_k, MmvQ6K, MMV_R, ) // bounded to 80 registers its 56 of weights in flight spill (ptxas -v)
STRATA_MMV_MOE_GROUP(q4_k, MmvQ4K, MMV_MOE_BOUNDS)
#ifndef MMV_Q6K_F32
STRATA_MMV_MOE_GROUP(q6_k, MmvQ6K, ) // unbounded, as mmv_moe_q6_k (its weights in flight spill at 80 registers)
#else
// A measurement build with f32 activations for Q6_K (MMV_Q6K_F32) has no grouped Q6_K kernel to run: a step that
// asks for it stops.
extern "C" __global__ void mmv_moe_group_q6_k(const u8*, const u8*, const float*, float*, float*, const int*, int, int,
                                              int, long long, long long, const float*, int, int) {
    pdl_enter();
    __trap();
}
#endif

// q8k_stage: the n_tok activation rows x[t] (cols values, a multiple of 256, at most MMV_X_MAX) quantized to Q8_K
// as stage_q8k stages them, into out[t] in global memory, in Q4_K's lane order or (natural) Q6_K's: once for a
// launch of mmvt_T, whose blocks all read them (from L1), where staging them in each block cost more than the
// weights' loads. With xu (rows as x's), row t is glu_act(x[t]) * xu[t] (act: glu_code), the GLU of a prompt
// step's gated rows computed as they are quantized for the down projection. Grid (n_tok, ceil(cols / 2048)), block
// 256: warp w stages super-block 8 blockIdx.y + w.
static_assert(sizeof(Q8kStage) == 5184, "Q8K_STAGE_BYTES in cuda/matmul.rs");
extern "C" __global__ void q8k_stage(const float* __restrict__ x, const float* __restrict__ xu, Q8kStage* __restrict__ out,
                                     int cols, int act, int natural) {
    pdl_enter();
    int t = blockIdx.x, sb = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (sb >= cols / 256) return; // a whole warp
    const float* xt = x + (long long)t * cols;
    const float* ut = xu ? xu + (long long)t * cols : nullptr;
    if (natural)
        stage_q8k_sb<true>(xt, ut, act, sb, out[t]);
    else
        stage_q8k_sb<false>(xt, ut, act, sb, out[t]);
}

// mmvt_T: mmv_T for a step of several tokens (a batch of decode steps, a short prompt chunk): each weight row is
// loaded once for up to MMV_T tokens (blockIdx.y's: tokens MMV_T y .. MMV_T y + MMV_T - 1), so a step of n tokens
// reads each matrix ceil(n / MMV_T) times instead of n times. The activations come staged by q8k_stage (st[t], in
// the type's lane order, read through L1). A warp computes R rows (4 in mmvt_T, 1 in mmvt1_T) as mmv_fast_rows
// lays them out: eight lanes a super-block, four super-blocks a warp step; a lane decodes a loaded part's scales
// once for all the tokens, and a token's sums take one order whatever the step's other tokens are, so a token
// gets the same bits alone and in any step (this is the batch-invariant dense kernel too). Rows are numbered over
// the three matrices as in mmv_T. Grid (ceil((r0 + r1 + r2) / (8 R)), ceil(n_tok / MMV_T)), block 256. Q4_K and
// Q6_K rows of 256 to MMV_X_MAX values, a multiple of 256 (the host checks: cuda/matmul.rs, mmvt_fits).
#define MMV_T 8
template <class Q, int R>
__device__ __forceinline__ void mmvt_rows(const u8* const* w, const Q8kStage* __restrict__ st, int n, int cols,
                                          int lane, float (*acc)[MMV_T]) {
    int nsb = cols / 256, p = lane & 7;
    typename Q::Part f[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < MMV_T; ++t) acc[r][t] = 0.f;
    mmv_load_step<Q, R>(f, w, 0, nsb, lane);
    pdl_enter(); // the weights' first loads are in flight; the staged activations come from the kernel before
    for (int base = 0; base < nsb; base += 8) {
        if (base > 0) mmv_load_step<Q, R>(f, w, base, nsb, lane);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            int sb = base + (lane >> 3) + 4 * u;
            if (sb >= nsb) continue;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (!w[r]) continue;
                typename Q::Scales k = Q::scales(f[r][u], w[r] + Q::SB_BYTES * sb, p);
                typename Q::Codes c = Q::codes(f[r][u]);
#pragma unroll
                for (int t = 0; t < MMV_T; ++t)
                    if (t < n) acc[r][t] += Q::dot_q8c(c, k, st[t], sb, p);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < MMV_T; ++t) acc[r][t] = warp_sum(acc[r][t]);
}
#define STRATA_MMVT(name, Q, pre, R)                                                                            \
    extern "C" __global__ void pre##name(const u8* __restrict__ w0, const u8* __restrict__ w1,                 \
                                         const u8* __restrict__ w2, const Q8kStage* __restrict__ st,           \
                                         float* __restrict__ y0, float* __restrict__ y1,                       \
                                         float* __restrict__ y2, int r0, int r1, int r2, int cols,             \
                                         long long row_bytes, int n_tok) {                                      \
        int lane = threadIdx.x & 31, t0 = blockIdx.y * MMV_T, n = min(MMV_T, n_tok - t0);                      \
        int first = (blockIdx.x * 8 + (threadIdx.x >> 5)) * R;                                                  \
        const u8* w[R];                                                                                         \
        float* y[R];                                                                                            \
        int rows[R];                                                                                            \
        _Pragma("unroll") for (int i = 0; i < R; ++i) {                                                         \
            int r = first + i;                                                                                  \
            w[i] = nullptr, y[i] = nullptr, rows[i] = 0;                                                        \
            if (r < r0) {                                                                                       \
                w[i] = w0 + (long long)r * row_bytes, y[i] = y0 + r, rows[i] = r0;                              \
            } else if ((r -= r0) < r1) {                                                                        \
                w[i] = w1 + (long long)r * row_bytes, y[i] = y1 + r, rows[i] = r1;                              \
            } else if ((r -= r1) < r2) {                                                                        \
                w[i] = w2 + (long long)r * row_bytes, y[i] = y2 + r, rows[i] = r2;                              \
            }                                                                                                   \
        }                                                                                                       \
        float acc[R][MMV_T];                                                                                    \
        mmvt_rows<Q, R>(w, st + t0, n, cols, lane, acc);                                                        \
        if (lane == 0)                                                                                          \
            _Pragma("unroll") for (int i = 0; i < R; ++i)                                                       \
                _Pragma("unroll") for (int t = 0; t < MMV_T; ++t)                                               \
                    if (w[i] && t < n) y[i][(long long)(t0 + t) * rows[i]] = acc[i][t];                         \
    }
STRATA_MMVT(q4_k, MmvQ4K, mmvt_, MMV_R)
STRATA_MMVT(q4_k, MmvQ4K, mmvt1_, 1)

// Tensor cores, integers: c += a * b for one m16n8k32 tile, s8 operands, s32 accumulation (PTX mma.sync; sm_80
// and later; exact). a: the 16x32 row-major A fragment (4 registers of four bytes: rows g and g + 8, k 4 q..4 q + 3
// and 16 + 4 q.., with g = lane / 4, q = lane % 4), b0/b1 the 32x8 column-major B fragment (column g, the same k),
// c: rows g and g + 8, columns 2 q and 2 q + 1. Source: PTX ISA, "Matrix Fragments for mma.m16n8k32".
__device__ __forceinline__ void mma_s8_16832(int* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// As mma_s8_16832 for one m16n8k16 tile: a0 / a1 hold rows g and g + 8, k 4 q..4 q + 3; b0 column g, the same k.
__device__ __forceinline__ void mma_s8_16816(int* c, u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}
__device__ __forceinline__ u32 ld4_a2(const u8* p) {
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// mmq_T: mmvt_T on the integer tensor cores (the arithmetic of llama.cpp's MMQ, laid out for a decode step of a
// few tokens), Q4_K and Q6_K: a block computes two tiles of 16 rows (MMQ_DENSE_RT; over the three matrices,
// numbered as in mmv_T) for the MMV_T tokens blockIdx.y * MMV_T.. (fewer at the end: the absent columns are
// computed from the last token and not written), four warps a tile splitting its super-blocks (warp w of a tile:
// w, w + 4, ..; the next one's weights load while one is computed), their sums added in warp order through shared
// memory. Per super-block a warp runs an integer mma per sub-block of the type's scales (Q::add): the A fragment
// holds rows g and g + 8's codes, the B fragment token g's Q8_K codes (q8k_stage, NATURAL layout) at the same
// positions (any order of k gives the same integer sum).
// Per row and token the scale-weighted sums are exact in 32 bits; then f32 per super-block, in the CPU's
// vec_dot_q8 form, not in mmvt's order of float sums (within float rounding of it). A token's columns never mix
// with another's, so its result does not depend on the step's other tokens. Grid (ceil((r0 + r1 + r2) / 32),
// ceil(n_tok / MMV_T)), block 256; rows of 256 to MMV_X_MAX values, a multiple of 256 (the host checks:
// cuda/matmul.rs, mmvt_fits).
#define MMQ_ROWS 16
// Super-block sb's 16 sums of 16 values of the stages x0 and x1, two to a word, into bw0 and bw1.
__device__ __forceinline__ void mmq_bsums(const Q8kStage& x0, const Q8kStage& x1, int sb, u32* bw0, u32* bw1) {
    const uint4* b0 = (const uint4*)(x0.bsum + sb * 16);
    const uint4* b1 = (const uint4*)(x1.bsum + sb * 16);
    uint4 b0l = b0[0], b0h = b0[1], b1l = b1[0], b1h = b1[1];
    u32 v0[8] = {b0l.x, b0l.y, b0l.z, b0l.w, b0h.x, b0h.y, b0h.z, b0h.w};
    u32 v1[8] = {b1l.x, b1l.y, b1l.z, b1l.w, b1h.x, b1h.y, b1h.z, b1h.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) bw0[k] = v0[k], bw1[k] = v1[k];
}

// Q4_K: one mma.m16n8k32 per 32-value sub-block s = 2 j + hl. Code byte 32 j + l of a super-block holds value
// 64 j + l in its low nibble and that + 32 in its high; a lane takes eight consecutive bytes of both A and B (k
// 4 q.. of the fragment is byte 8 q.., k 16 + 4 q.. byte 8 q + 4..). Per row and token: the sums over sub-blocks
// of scale * (codes . x) and of min * (sum of x) (below 2^25 and 2^21), then d_x * (d * that - dmin * this).
struct MmqQ4K {
    struct Frag {
        uint4 head[2]; // rows g and g + 8: {d, dmin, scales[12]}
        u64 q[2][4];   // rows g and g + 8: code bytes 32 j + 8 q.. of the super-block
    };
    static __device__ __forceinline__ void load(Frag& f, const u8* const* w, int sb, int q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (!w[h]) {
                f.head[h] = make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < 4; ++j) f.q[h][j] = 0;
                continue;
            }
            const u8* b = w[h] + 144LL * sb;
            f.head[h] = *(const uint4*)b;
#pragma unroll
            for (int j = 0; j < 4; ++j) f.q[h][j] = *(const u64*)(b + 16 + 32 * j + 8 * q);
        }
    }
    // acc += super-block sb's products; xb: token g's codes, x0 / x1: tokens 2 q and 2 q + 1's stages.
    static __device__ __forceinline__ void add(const Frag& f, const u8* xb, const Q8kStage& x0, const Q8kStage& x1,
                                               int sb, int q, float* acc) {
        // Rows g and g + 8's 6-bit scales and mins, four sub-blocks to a word (scale_min_k4).
        u32 scw[2][2], mw[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 a = f.head[h].y, b = f.head[h].z, c = f.head[h].w;
            scw[h][0] = a & 0x3F3F3F3Fu;
            mw[h][0] = b & 0x3F3F3F3Fu;
            scw[h][1] = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
            mw[h][1] = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
        }
        int isum[4] = {0, 0, 0, 0}, msum[4] = {0, 0, 0, 0};
        u32 bw0[8], bw1[8];
        mmq_bsums(x0, x1, sb, bw0, bw1);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int hl = 0; hl < 2; ++hl) {
                int s = 2 * j + hl, sh = 4 * hl;
                u32 a[4] = {((u32)f.q[0][j] >> sh) & 0x0F0F0F0Fu, ((u32)f.q[1][j] >> sh) & 0x0F0F0F0Fu,
                            ((u32)(f.q[0][j] >> 32) >> sh) & 0x0F0F0F0Fu,
                            ((u32)(f.q[1][j] >> 32) >> sh) & 0x0F0F0F0Fu};
                u64 x = *(const u64*)(xb + q8k_natural(256 * sb + 64 * j + 32 * hl + 8 * q));
                int c[4] = {0, 0, 0, 0};
                mma_s8_16832(c, a, (u32)x, (u32)(x >> 32));
                int at = 8 * (s & 3);
                int sg = (scw[0][s >> 2] >> at) & 0xFF, s8 = (scw[1][s >> 2] >> at) & 0xFF;
                int mg = (mw[0][s >> 2] >> at) & 0xFF, m8 = (mw[1][s >> 2] >> at) & 0xFF;
                isum[0] += sg * c[0];
                isum[1] += sg * c[1];
                isum[2] += s8 * c[2];
                isum[3] += s8 * c[3];
                // The sums of the 32 values of sub-block s: two of Q8_K's sums of 16.
                int e0 = (int)(short)(bw0[s] & 0xFFFF) + ((int)bw0[s] >> 16);
                int e1 = (int)(short)(bw1[s] & 0xFFFF) + ((int)bw1[s] >> 16);
                msum[0] += mg * e0;
                msum[1] += mg * e1;
                msum[2] += m8 * e0;
                msum[3] += m8 * e1;
            }
        float d0 = x0.d[sb], d1 = x1.d[sb];
        float dg = h2f((u16)(f.head[0].x & 0xFFFF)), ng = h2f((u16)(f.head[0].x >> 16));
        float d8 = h2f((u16)(f.head[1].x & 0xFFFF)), n8 = h2f((u16)(f.head[1].x >> 16));
        acc[0] += d0 * (dg * (float)isum[0] - ng * (float)msum[0]);
        acc[1] += d1 * (dg * (float)isum[1] - ng * (float)msum[1]);
        acc[2] += d0 * (d8 * (float)isum[2] - n8 * (float)msum[2]);
        acc[3] += d1 * (d8 * (float)isum[3] - n8 * (float)msum[3]);
    }
};

// Q6_K: scales per 16 values, so one mma.m16n8k16 per 16-value sub-block s = v / 16 = 8 n + 2 i + hh. The code of
// value 128 n + 32 i + l is ql byte 64 n + 32 (i % 2) + l (its high nibble when i >= 2) with qh byte 32 n + l's
// bits 2 i.. above; a lane takes l = 16 hh + 4 q... Super-blocks are 210 bytes, so half start 2 bytes off a 4-byte
// boundary: 2-byte loads. Per row and token: the sum over sub-blocks of scale * (q . x - 32 * sum of x) (below
// 2^29), then d_x * d times that.
struct MmqQ6K {
    struct Frag {
        u32 l[2][2][2][2]; // [row g / g + 8][half n][hh][ql byte 64 n + l / 64 n + 32 + l]
        u32 qh[2][2][2];   // [row][n][hh]: qh byte 32 n + l
        u32 sc[2][4];      // [row]: the 16 scales (i8)
        u32 d[2];          // [row]: d (f16)
    };
    static __device__ __forceinline__ void load(Frag& f, const u8* const* w, int sb, int q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (!w[h]) {
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) f.l[h][n][hh][0] = f.l[h][n][hh][1] = f.qh[h][n][hh] = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) f.sc[h][k] = 0;
                f.d[h] = 0;
                continue;
            }
            const u8* b = w[h] + 210LL * sb;
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int l = 16 * hh + 4 * q;
                    f.l[h][n][hh][0] = ld4_a2(b + 64 * n + l);
                    f.l[h][n][hh][1] = ld4_a2(b + 64 * n + 32 + l);
                    f.qh[h][n][hh] = ld4_a2(b + 128 + 32 * n + l);
                }
#pragma unroll
            for (int k = 0; k < 4; ++k) f.sc[h][k] = ld4_a2(b + 192 + 4 * k);
            f.d[h] = *(const u16*)(b + 208);
        }
    }
    static __device__ __forceinline__ void add(const Frag& f, const u8* xb, const Q8kStage& x0, const Q8kStage& x1,
                                               int sb, int q, float* acc) {
        int isum[4] = {0, 0, 0, 0};
        u32 bw0[8], bw1[8];
        mmq_bsums(x0, x1, sb, bw0, bw1);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int s = 8 * n + 2 * i + hh;
                    u32 a[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        u32 lw = f.l[h][n][hh][i & 1];
                        a[h] = ((i >= 2 ? lw >> 4 : lw) & 0x0F0F0F0Fu) |
                               (((f.qh[h][n][hh] >> (2 * i)) & 0x03030303u) << 4);
                    }
                    u32 x = *(const u32*)(xb + q8k_natural(256 * sb + 16 * s + 4 * q));
                    int c[4] = {0, 0, 0, 0};
                    mma_s8_16816(c, a[0], a[1], x);
                    int at = 8 * (s & 3);
                    int sg = (int)(i8)((f.sc[0][s >> 2] >> at) & 0xFF), s8 = (int)(i8)((f.sc[1][s >> 2] >> at) & 0xFF);
                    u32 p0 = bw0[s >> 1], p1 = bw1[s >> 1];
                    int e0 = (s & 1) ? ((int)p0 >> 16) : (int)(short)(p0 & 0xFFFF);
                    int e1 = (s & 1) ? ((int)p1 >> 16) : (int)(short)(p1 & 0xFFFF);
                    isum[0] += sg * (c[0] - 32 * e0);
                    isum[1] += sg * (c[1] - 32 * e1);
                    isum[2] += s8 * (c[2] - 32 * e0);
                    isum[3] += s8 * (c[3] - 32 * e1);
                }
        float d0 = x0.d[sb], d1 = x1.d[sb];
        float dg = h2f((u16)f.d[0]), d8 = h2f((u16)f.d[1]);
        acc[0] += dg * d0 * (float)isum[0];
        acc[1] += dg * d1 * (float)isum[1];
        acc[2] += d8 * d0 * (float)isum[2];
        acc[3] += d8 * d1 * (float)isum[3];
    }
};

// The tile of a block's RT tiles of 16 rows that the calling warp works on in mmq_sums.
template <int RT>
__device__ __forceinline__ int mmq_warp_tile() {
    return RT == 1 ? 0 : (int)(threadIdx.x >> 5) / (8 / RT);
}
// The row whose sum mmq_sums returns to the calling thread i < 128 RT (row i % 128 / 8 of tile i / 128, its token
// i % 8), the block's first tile being tile0 (16 tile0 its first row).
template <int RT>
__device__ __forceinline__ int mmq_sum_row(int tile0) {
    int i = (int)threadIdx.x;
    return RT == 1 ? tile0 * MMQ_ROWS + i / MMV_T
                   : (tile0 + i / (MMQ_ROWS * MMV_T)) * MMQ_ROWS + i % (MMQ_ROWS * MMV_T) / MMV_T;
}
// The block's sums for the lane's rows w[0] and w[1] (g and g + 8 of its warp's tile; null: absent) over nsb
// super-blocks, token g's stage sg the B column, sc0 / sc1 (tokens 2 q and 2 q + 1) the C columns; wait: pdl_enter
// once the first weights are in flight (else the caller has waited). The block's 8 warps split RT tiles of 16 rows
// (warp w works on tile w / (8 / RT)), each tile's warps its super-blocks. Returns, to thread i < 128 RT, the sum
// of row i % 128 / 8 of tile i / 128 and token i % 8 (a tile's warps' sums added in warp order through shared
// memory); every thread calls it.
template <class Q, int RT = 1>
__device__ __forceinline__ float mmq_sums(const u8* const* w, int nsb, const Q8kStage* sg, const Q8kStage* sc0,
                                          const Q8kStage* sc1, bool wait) {
    static_assert(RT == 1 || RT == 2, "a block's 256 threads return the sums of two tiles at most");
    constexpr int WT = 8 / RT; // warps a tile
    __shared__ float red[8][MMQ_ROWS * MMV_T];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    int wt = RT == 1 ? warp : warp % WT;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}; // (row g, token 2 q), (g, 2 q + 1), (g + 8, 2 q), (g + 8, 2 q + 1)
    typename Q::Frag cur;
    if (wt < nsb) Q::load(cur, w, wt, q);
    if (wait) pdl_enter(); // the weights' first loads are in flight; the staged activations come from the kernel before
    const u8* xb = (const u8*)sg->codes;
    const Q8kStage& x0 = *sc0;
    const Q8kStage& x1 = *sc1;
    for (int sb = wt; sb < nsb; sb += WT) {
        typename Q::Frag nxt;
        if (sb + WT < nsb) Q::load(nxt, w, sb + WT, q);
        Q::add(cur, xb, x0, x1, sb, q, acc);
        if (sb + WT < nsb) cur = nxt;
    }
    red[warp][g * MMV_T + 2 * q] = acc[0];
    red[warp][g * MMV_T + 2 * q + 1] = acc[1];
    red[warp][(g + 8) * MMV_T + 2 * q] = acc[2];
    red[warp][(g + 8) * MMV_T + 2 * q + 1] = acc[3];
    __syncthreads();
    float s = 0.f;
    if (threadIdx.x < MMQ_ROWS * MMV_T * RT) {
        int t0 = RT == 1 ? 0 : threadIdx.x / (MMQ_ROWS * MMV_T) * WT;
        unsigned j = RT == 1 ? threadIdx.x : threadIdx.x % (MMQ_ROWS * MMV_T);
#pragma unroll
        for (int k = 0; k < WT; ++k) s += red[t0 + k][j];
    }
    return s;
}
// Tiles of 16 rows a block of mmq_T computes (the host's MMQ_DENSE_ROWS is 16 times this; a grid sized for fewer
// rows a block would leave rows unwritten: compile.rs tests that the two agree): 2, four warps a tile,
// as mmq_moe_T. At one tile a block a 2,048-wide row gave each warp one super-block, nothing to pipeline. For the
// steps of 2 to STRATA_MMV_DENSE_TOKENS tokens that take mmq_* (decode batches, short prompts): on an H100, 30B
// shape, tg32 x8 1,258.5 tok/s against 1,244.3 at one tile, pp16 1,754.7 against 1,735.6
// (reports/2026-12-07-h100-mmq-prefill-256/).
constexpr int MMQ_DENSE_RT = 2;
template <class Q, int RT>
__device__ __forceinline__ void mmq_tiles(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                          const u8* __restrict__ w2, const Q8kStage* __restrict__ st,
                                          float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                                          int r0, int r1, int r2, int cols, long long row_bytes, int n_tok) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int t0 = blockIdx.y * MMV_T, n = min(MMV_T, n_tok - t0);
    if (RT > 1 && (int)blockIdx.x * RT * MMQ_ROWS >= r0 + r1 + r2) {
        pdl_enter(); // every kernel waits before its dependents launch
        return;
    }
    int tl = mmq_warp_tile<RT>();
    // Rows g and g + 8 of the warp's tile (null: past the last).
    const u8* w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int r = (blockIdx.x * RT + tl) * MMQ_ROWS + g + 8 * h;
        w[h] = nullptr;
        if (r < r0)
            w[h] = w0 + (long long)r * row_bytes;
        else if ((r -= r0) < r1)
            w[h] = w1 + (long long)r * row_bytes;
        else if ((r -= r1) < r2)
            w[h] = w2 + (long long)r * row_bytes;
    }
    float s = mmq_sums<Q, RT>(w, cols / 256, st + t0 + min(g, n - 1), st + t0 + min(2 * q, n - 1),
                              st + t0 + min(2 * q + 1, n - 1), true);
    int i = threadIdx.x, t = i % MMV_T;
    if (i >= MMQ_ROWS * MMV_T * RT || t >= n) return;
    int r = mmq_sum_row<RT>(blockIdx.x * RT);
    if (r < r0)
        y0[(long long)(t0 + t) * r0 + r] = s;
    else if ((r -= r0) < r1)
        y1[(long long)(t0 + t) * r1 + r] = s;
    else if ((r -= r1) < r2)
        y2[(long long)(t0 + t) * r2 + r] = s;
}
#define STRATA_MMQ(name, Q)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
        mmq_##name(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,            \
                   const Q8kStage* __restrict__ st, float* __restrict__ y0, float* __restrict__ y1,            \
                   float* __restrict__ y2, int r0, int r1, int r2, int cols, long long row_bytes, int n_tok) { \
        mmq_tiles<Q, MMQ_DENSE_RT>(w0, w1, w2, st, y0, y1, y2, r0, r1, r2, cols, row_bytes, n_tok);            \
    }
STRATA_MMQ(q4_k, MmqQ4K)
STRATA_MMQ(q6_k, MmqQ6K)

// Tiles of 16 rows a block of mmq_moe_T computes (the host's MMQ_MOE_ROWS is 16 times this): 2, four warps a tile.
// With 1, a width of 2,048 gave each of a block's 8 warps one super-block (nothing to pipeline) and an expert's down
// projection of 768 left 5 of them idle. On an H100, 30B shape: pp128 4,894 tok/s against 4,407 with 1, pp16 1,562
// against 1,502 (reports/2026-12-07-h100-moe-mmq/).
constexpr int MMQ_MOE_RT = 2;
// mmq_moe_T takes the compiler's choice of registers: 128 a thread, 2 blocks an SM (Nsight Compute on an H100,
// pp128, a layer's gate launch: 24% of the warps active, DRAM 24% of peak, long-scoreboard stalls leading). Asked
// for 3 blocks (at most 80 registers) NVRTC spills 144/112 bytes in mmq_moe_q4_k, and pp128 fell 8%
// (reports/2026-12-07-h100-mmq-knobs/, 2026-12-07-h100-mmq-prefill-256/).
#define MMQ_MOE_BOUNDS __launch_bounds__(256)

// mmq_moe_T: a MoE layer's experts over a prompt's tokens grouped by expert (the prefill path's grouped rows), on
// the integer tensor cores as mmq_T, for experts with few tokens each (a short prompt), where the prefill GEMM
// dequantizes every weight tile to f16 for a handful of rows. Work list: tiles[3 i..3 i + 3] = (expert or cache
// slot id, first grouped row, rows <= MMV_T); grouped row r reads stage st[xrows[r]] (st[r] without xrows: the
// activations are the grouped rows themselves) and writes y[r][0..n_out). Block (x, i) computes outputs
// 16 MMQ_MOE_RT x.. of tile i for its rows (the absent columns are computed from the tile's last row and not
// written). Grid (ceil(n_out / (16 MMQ_MOE_RT)), tiles), block 256; the expert's rows of cols values (a multiple of
// 256, at most MMV_X_MAX) row_bytes apart, experts expert_stride bytes apart from w. The block's tile tl is its
// warps tl * 8 / MMQ_MOE_RT onwards; a tile past the rows loads nothing and writes nothing.
template <class Q>
__device__ __forceinline__ void mmq_moe(const u8* __restrict__ w, long long expert_stride, long long row_bytes,
                                        const int* __restrict__ tiles, const Q8kStage* __restrict__ st,
                                        const u32* __restrict__ xrows, float* __restrict__ y, int n_out, int cols) {
    constexpr int RT = MMQ_MOE_RT;
    pdl_enter(); // the work list and the stages come from the launches before
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, tl = mmq_warp_tile<RT>();
    const int* tile = tiles + 3 * blockIdx.y;
    int e = tile[0], first = tile[1], rows = tile[2];
    const u8* base = w + (long long)e * expert_stride;
    const u8* wr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int r = (blockIdx.x * RT + tl) * MMQ_ROWS + g + 8 * h;
        wr[h] = r < n_out ? base + (long long)r * row_bytes : nullptr;
    }
    auto stage = [&](int t) {
        int r = first + min(t, rows - 1);
        return st + (xrows ? xrows[r] : r);
    };
    float s = mmq_sums<Q, RT>(wr, cols / 256, stage(g), stage(2 * q), stage(2 * q + 1), false);
    int t = (int)threadIdx.x % (MMQ_ROWS * MMV_T) % MMV_T, o = mmq_sum_row<RT>(blockIdx.x * RT);
    if ((int)threadIdx.x < MMQ_ROWS * MMV_T * RT && t < rows && o < n_out) y[(long long)(first + t) * n_out + o] = s;
}
#define STRATA_MMQ_MOE(name, Q)                                                                                 \
    extern "C" __global__ void MMQ_MOE_BOUNDS                                                                  \
        mmq_moe_##name(const u8* __restrict__ w, long long expert_stride, long long row_bytes,                  \
                       const int* __restrict__ tiles, const Q8kStage* __restrict__ st,                          \
                       const u32* __restrict__ xrows, float* __restrict__ y, int n_out, int cols) {             \
        mmq_moe<Q>(w, expert_stride, row_bytes, tiles, st, xrows, y, n_out, cols);                              \
    }
STRATA_MMQ_MOE(q4_k, MmqQ4K)
STRATA_MMQ_MOE(q6_k, MmqQ6K)
#ifndef MMV_Q6K_F32
STRATA_MMVT(q6_k, MmvQ6K, mmvt_, MMV_R)
STRATA_MMVT(q6_k, MmvQ6K, mmvt1_, 1)
#else
// A measurement build with f32 activations for Q6_K (MMV_Q6K_F32): no Q8_K kernel of several tokens; a step that
// asks for it stops.
extern "C" __global__ void mmvt_q6_k(const u8*, const u8*, const u8*, const Q8kStage*, float*, float*, float*, int,
                                     int, int, int, long long, int) {
    pdl_enter();
    __trap();
}
extern "C" __global__ void mmvt1_q6_k(const u8*, const u8*, const u8*, const Q8kStage*, float*, float*, float*, int,
                                      int, int, int, long long, int) {
    pdl_enter();
    __trap();
}
#endif

// moe_groups: the routing slots of a step of several tokens grouped by expert for mmv_moe_group_T. ids: n slots'
// expert (or cache slot) ids, MOE_SKIP for a slot to leave out; groups as mmv_moe_group_T reads it: slots sorted by
// (id, slot), each id's run cut into groups of at most MOE_GROUP_T. One block of a power of two of threads, at
// least n and at most MOE_GROUP_MAX_SLOTS: thread s ranks slot s among all (n comparisons), then a scan of the
// group starts numbers the groups.
extern "C" __global__ void __launch_bounds__(MOE_GROUP_MAX_SLOTS) moe_groups(const u32* __restrict__ ids, int n,
                                                                            int* __restrict__ groups) {
    __shared__ u32 sid[MOE_GROUP_MAX_SLOTS];
    __shared__ short sorder[MOE_GROUP_MAX_SLOTS];
    __shared__ int scan[MOE_GROUP_MAX_SLOTS];
    pdl_enter();
    int s = threadIdx.x;
    u32 id = s < n ? ids[s] : MOE_SKIP;
    sid[s] = id;
    scan[s] = 0;
    __syncthreads();
    int rank = 0, lt = 0, cnt = 0;
    for (int o = 0; o < n; ++o) {
        u32 v = sid[o];
        lt += v < id;
        cnt += v == id;
        rank += v < id || (v == id && o < s);
    }
    int j = rank - lt; // the slot's place in its id's run
    bool start = s < n && id != MOE_SKIP && j % MOE_GROUP_T == 0;
    if (s < n) {
        sorder[rank] = (short)s;
        scan[rank] = start;
    }
    __syncthreads();
    for (int off = 1; off < (int)blockDim.x; off <<= 1) {
        int v = s >= off ? scan[s - off] : 0;
        __syncthreads();
        scan[s] += v;
        __syncthreads();
    }
    if (start) {
        int m = min(MOE_GROUP_T, cnt - j);
        int* gr = groups + 1 + (scan[rank] - 1) * MOE_GROUP_INTS;
        gr[0] = (int)id;
        gr[1] = m;
        for (int t = 0; t < m; ++t) gr[2 + t] = sorder[rank + t];
    }
    if (s == (int)blockDim.x - 1) groups[0] = scan[s];
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

// The other types: no prefetch, the activation row staged in natural order, the generic 32-value chunk dot
// (f32 and f16 with their coalesced dots above).
#define STRATA_MMV_HOOKS(name, dot)                                                                             \
    struct MmvPre_##name {};                                                                                    \
    __device__ __forceinline__ void mmv_load_##name(MmvPre_##name&, const u8*, int, int) {}                     \
    __device__ __forceinline__ const float* mmv_stage_##name(const float* __restrict__ xt, int cols, bool* perm) { \
        *perm = false;                                                                                          \
        return mmv_stage_x(xt, cols);                                                                           \
    }                                                                                                           \
    __device__ __forceinline__ float mmv_dot_##name(MmvPre_##name&, const u8* __restrict__ row,                 \
                                                    const float* __restrict__ xt, bool, int cols, int lane) {   \
        return dot(row, xt, cols, lane);                                                                        \
    }
STRATA_MMV_HOOKS(f32, mmv_dot_fast_f32)
STRATA_MMV_HOOKS(f16, mmv_dot_fast_f16)

// Per type: its hooks come with its kernels (the generic chunk dot), or were defined above (the fast dots).
#define MMV_HOOKS_f32
#define MMV_HOOKS_f16
#define MMV_HOOKS_bf16 STRATA_MMV_HOOKS(bf16, mmv_dot32_bf16)
#define MMV_HOOKS_q4_0 STRATA_MMV_HOOKS(q4_0, mmv_dot32_q4_0)
#define MMV_HOOKS_q4_1 STRATA_MMV_HOOKS(q4_1, mmv_dot32_q4_1)
#define MMV_HOOKS_q5_0 STRATA_MMV_HOOKS(q5_0, mmv_dot32_q5_0)
#define MMV_HOOKS_q5_1 STRATA_MMV_HOOKS(q5_1, mmv_dot32_q5_1)
#define MMV_HOOKS_q8_0 STRATA_MMV_HOOKS(q8_0, mmv_dot32_q8_0)
#define MMV_HOOKS_q2_k STRATA_MMV_HOOKS(q2_k, mmv_dot32_q2_k)
#define MMV_HOOKS_q3_k STRATA_MMV_HOOKS(q3_k, mmv_dot32_q3_k)
#define MMV_HOOKS_q5_k STRATA_MMV_HOOKS(q5_k, mmv_dot32_q5_k)

#define STRATA_ROWS_OF(name, dq) STRATA_ROWS(name, DQ_FAST_##name)
STRATA_FOR_EACH_QTYPE(STRATA_ROWS_OF)
// The generic matrix-vector kernels, for every type but Q4_K and Q6_K (STRATA_MMV_FAST above).
STRATA_MMV(f32, dq32_f32)
STRATA_MMV(f16, dq32_f16)
STRATA_MMV(bf16, dq32_bf16)
STRATA_MMV(q4_0, dq32_q4_0)
STRATA_MMV(q4_1, dq32_q4_1)
STRATA_MMV(q5_0, dq32_q5_0)
STRATA_MMV(q5_1, dq32_q5_1)
STRATA_MMV(q8_0, dq32_q8_0)
STRATA_MMV(q2_k, dq32_q2_k)
STRATA_MMV(q3_k, dq32_q3_k)
STRATA_MMV(q5_k, dq32_q5_k)

// f32 -> f16 bits, n values (the GEMM's activations): eight per thread, two 16-byte loads and one 16-byte store
// where both buffers are 16-byte aligned and the eight are whole. Grid ceil(n / 8 / 256), block 256.
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, long long n) {
    pdl_enter();
    long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    if (i + 8 <= n && ((reinterpret_cast<u64>(x) | reinterpret_cast<u64>(out)) & 15) == 0) {
        float4 a = *(const float4*)(x + i), b = *(const float4*)(x + i + 4);
        *(uint4*)(out + i) = make_uint4(pack_h2(f2h(a.x), f2h(a.y)), pack_h2(f2h(a.z), f2h(a.w)),
                                        pack_h2(f2h(b.x), f2h(b.y)), pack_h2(f2h(b.z), f2h(b.w)));
    } else {
        for (long long j = i; j < i + 8 && j < n; ++j) out[j] = f2h(x[j]);
    }
}

// y[t][r] = W[r] . x[t] for an f32 matrix of few rows (a MoE router: 128 rows of 2048): one block of 256 per row
// and token, its eight warps splitting the row, so the matrix is read by as many SMs as it has rows instead of by
// rows / 8. Grid (rows, n_tok), block 256.
// Block (r, t)'s dot product of f32 row r of w with activation row t (8 warps, 256 threads), into y[t][r] (thread 0
// writes it).
__device__ __forceinline__ void wide_dot_block(const float* __restrict__ w, const float* __restrict__ x,
                                               float* __restrict__ y, int rows, int cols) {
    __shared__ float part[8];
    int r = blockIdx.x, t = blockIdx.y;
    const float4* w4 = (const float4*)(w + (long long)r * cols);
    const float4* x4 = (const float4*)(x + (long long)t * cols);
    float4 a0 = threadIdx.x < cols / 4 ? w4[threadIdx.x] : make_float4(0.f, 0.f, 0.f, 0.f);
    pdl_enter(); // the weights' first load is in flight
    float acc = 0.f;
    for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
        float4 a = i == threadIdx.x ? a0 : w4[i], b = x4[i];
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

extern "C" __global__ void mmv_wide_f32(const float* __restrict__ w, const float* __restrict__ x,
                                        float* __restrict__ y, int rows, int cols) {
    wide_dot_block(w, x, y, rows, cols);
}

// The MoE router's logits and choice in one launch (mmv_wide_f32, then moe_route): block (r, t) computes logit r of
// token t into y, and the last of token t's blocks to finish (counted in cnt[t], block_is_last) routes the token
// (moe_route_block) into ids and wts, [n_tok][k]; y keeps the logits.
// Grid (n_expert, n_tok), block 256; n_expert <= 1024, k <= 64.
extern "C" __global__ void router_route(const float* __restrict__ w, const float* __restrict__ x, float* y, int rows,
                                        int cols, u32* __restrict__ cnt, u32* __restrict__ ids,
                                        float* __restrict__ wts, int k, int normalize) {
    __shared__ float prob[1024];
    __shared__ u32 rid[64];
    __shared__ float rw[64];
    int t = blockIdx.y;
    wide_dot_block(w, x, y, rows, cols);
    if (!block_is_last(cnt + t, rows)) return;
    moe_route_block(y + (long long)t * rows, rows, k, normalize, prob, rid, rw);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        ids[(long long)t * k + i] = rid[i];
        wts[(long long)t * k + i] = rw[i];
    }
}
