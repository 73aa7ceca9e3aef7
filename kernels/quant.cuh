// Dequantization of one 32-value chunk of a row, for every block type the GPU computes with.
// `row` is the row's first byte, `c` the chunk (values 32c .. 32c+31), `v` receives the 32 values.
// Layouts and formulas: ggml's `dequantize_row_*` (ggml/src/ggml-quants.c); the CPU reference is
// engine/src/quant/reference.rs. 256-value super-blocks are read as 8 chunks of 32.

__device__ __forceinline__ void dq32_f32(const u8* row, int c, float* v) {
    const float* p = (const float*)row + 32 * c;
    for (int l = 0; l < 32; ++l) v[l] = p[l];
}
__device__ __forceinline__ void dq32_f16(const u8* row, int c, float* v) {
    const u16* p = (const u16*)row + 32 * c;
    for (int l = 0; l < 32; ++l) v[l] = h2f(p[l]);
}
__device__ __forceinline__ void dq32_bf16(const u8* row, int c, float* v) {
    const u16* p = (const u16*)row + 32 * c;
    for (int l = 0; l < 32; ++l) v[l] = bf2f(p[l]);
}
// Q4_0: {f16 d; u8 qs[16]}, 18 bytes.
__device__ __forceinline__ void dq32_q4_0(const u8* row, int c, float* v) {
    const u8* b = row + 18 * c;
    float d = h2f(ld16(b));
    for (int j = 0; j < 16; ++j) {
        v[j] = ((int)(b[2 + j] & 0xF) - 8) * d;
        v[j + 16] = ((int)(b[2 + j] >> 4) - 8) * d;
    }
}
// Q4_1: {f16 d; f16 m; u8 qs[16]}, 20 bytes.
__device__ __forceinline__ void dq32_q4_1(const u8* row, int c, float* v) {
    const u8* b = row + 20 * c;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    for (int j = 0; j < 16; ++j) {
        v[j] = (b[4 + j] & 0xF) * d + m;
        v[j + 16] = (b[4 + j] >> 4) * d + m;
    }
}
// Q5_0: {f16 d; u8 qh[4]; u8 qs[16]}, 22 bytes.
__device__ __forceinline__ void dq32_q5_0(const u8* row, int c, float* v) {
    const u8* b = row + 22 * c;
    float d = h2f(ld16(b));
    u32 qh = ld32(b + 2);
    for (int j = 0; j < 16; ++j) {
        int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
        v[j] = (((b[6 + j] & 0xF) | h0) - 16) * d;
        v[j + 16] = (((b[6 + j] >> 4) | h1) - 16) * d;
    }
}
// Q5_1: {f16 d; f16 m; u8 qh[4]; u8 qs[16]}, 24 bytes.
__device__ __forceinline__ void dq32_q5_1(const u8* row, int c, float* v) {
    const u8* b = row + 24 * c;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    u32 qh = ld32(b + 4);
    for (int j = 0; j < 16; ++j) {
        int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
        v[j] = ((b[8 + j] & 0xF) | h0) * d + m;
        v[j + 16] = ((b[8 + j] >> 4) | h1) * d + m;
    }
}
// Q8_0: {f16 d; i8 qs[32]}, 34 bytes.
__device__ __forceinline__ void dq32_q8_0(const u8* row, int c, float* v) {
    const u8* b = row + 34 * c;
    float d = h2f(ld16(b));
    for (int j = 0; j < 32; ++j) v[j] = (float)(i8)b[2 + j] * d;
}
// Q2_K: {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}, 84 bytes.
__device__ __forceinline__ void dq32_q2_k(const u8* row, int c, float* v) {
    const u8* b = row + 84 * (c >> 3);
    int s = c & 7, n = s >> 2, j = s & 3;
    float d = h2f(ld16(b + 80)), dmin = h2f(ld16(b + 82));
    const u8* q = b + 16 + 32 * n;
    for (int l = 0; l < 32; ++l) {
        u8 sc = b[n * 8 + 2 * j + (l >> 4)];
        v[l] = d * (sc & 0xF) * ((q[l] >> (2 * j)) & 3) - dmin * (sc >> 4);
    }
}
// Q3_K: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}, 110 bytes.
__device__ __forceinline__ void dq32_q3_k(const u8* row, int c, float* v) {
    const u8* b = row + 110 * (c >> 3);
    int s = c & 7, n = s >> 2, j = s & 3;
    float d = h2f(ld16(b + 108));
    const u8* hm = b;
    const u8* q = b + 32 + 32 * n;
    const u8* sc = b + 96;
    u8 m = (u8)(1 << (n * 4 + j));
    for (int l = 0; l < 32; ++l) {
        int i = n * 8 + 2 * j + (l >> 4);
        int lo = i < 8 ? (sc[i] & 0xF) : (sc[i - 8] >> 4);
        int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        int scale = (lo | (hi << 4)) - 32;
        int qv = (int)((q[l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4);
        v[l] = d * scale * qv;
    }
}
// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
// Q4_K: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}, 144 bytes.
__device__ __forceinline__ void dq32_q4_k(const u8* row, int c, float* v) {
    const u8* b = row + 144 * (c >> 3);
    int s = c & 7;
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    int sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    float d1 = d * sc, m1 = dmin * m;
    const u8* q = b + 16 + 32 * (s >> 1);
    int sh = 4 * (s & 1);
    for (int l = 0; l < 32; ++l) v[l] = d1 * ((q[l] >> sh) & 0xF) - m1;
}
// Q5_K: {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}, 176 bytes.
__device__ __forceinline__ void dq32_q5_k(const u8* row, int c, float* v) {
    const u8* b = row + 176 * (c >> 3);
    int s = c & 7;
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    int sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    float d1 = d * sc, m1 = dmin * m;
    const u8* qh = b + 16;
    const u8* q = b + 48 + 32 * (s >> 1);
    int sh = 4 * (s & 1);
    for (int l = 0; l < 32; ++l) v[l] = d1 * (((q[l] >> sh) & 0xF) + (((qh[l] >> s) & 1) << 4)) - m1;
}
// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}, 210 bytes.
__device__ __forceinline__ void dq32_q6_k(const u8* row, int c, float* v) {
    const u8* b = row + 210 * (c >> 3);
    int s = c & 7, n = s >> 2, part = s & 3;
    float d = h2f(ld16(b + 208));
    const u8* ql = b + 64 * n + ((part & 1) ? 32 : 0);
    const u8* qh = b + 128 + 32 * n;
    const i8* sc = (const i8*)(b + 192) + 8 * n;
    int lsh = (part >> 1) ? 4 : 0, hsh = 2 * part;
    for (int l = 0; l < 32; ++l) {
        int q = (int)(((ql[l] >> lsh) & 0xF) | (((qh[l] >> hsh) & 3) << 4)) - 32;
        v[l] = d * sc[(l >> 4) + 2 * part] * q;
    }
}

// A Q4_K 32-value chunk (chunk c of a row: sub-block c % 8 of super-block c / 8) as its bytes: the super-block
// head {d, dmin, scales[12]} and the chunk's 32 code bytes, three 16-byte loads (fetch), then the values (convert:
// scale_min_k4 on the head's words, scales[0..4) in h.y, [4..8) h.z, [8..12) h.w). The two steps apart let the
// prefill GEMM fetch a step ahead (GEMM_W_q4_k); a null row converts to zeros.
struct Q4kChunk {
    uint4 h, q0, q1;
    int s; // sub-block c % 8, or -1: absent (zeros)
    __device__ __forceinline__ void fetch(const u8* r, int c) {
        s = r ? (c & 7) : -1;
        if (!r) return;
        const u8* b = r + 144 * (c >> 3);
        h = *(const uint4*)b;
        const uint4* q = (const uint4*)(b + 16 + 32 * ((c & 7) >> 1));
        q0 = q[0], q1 = q[1];
    }
    __device__ __forceinline__ void convert(float* v) const {
        if (s < 0) {
#pragma unroll
            for (int i = 0; i < 32; ++i) v[i] = 0.f;
            return;
        }
        int at = 8 * (s & 3);
        u32 y = (h.y >> at) & 0xFF, z = (h.z >> at) & 0xFF, w = (h.w >> at) & 0xFF;
        int sc = s < 4 ? (int)(y & 63) : (int)((w & 0xF) | ((y >> 6) << 4));
        int m = s < 4 ? (int)(z & 63) : (int)((w >> 4) | ((z >> 6) << 4));
        float d1 = h2f((u16)(h.x & 0xFFFF)) * sc, m1 = h2f((u16)(h.x >> 16)) * m;
        u32 words[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        int sh = 4 * (s & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) v[4 * i + k] = d1 * (float)((words[i] >> (8 * k + sh)) & 0xF) - m1;
    }
};
// Q4_K chunk with 16-byte loads (the generic dequantizer reads bytes).
__device__ __forceinline__ void dq32_vec_q4_k(const u8* row, int c, float* v) {
    Q4kChunk k;
    k.fetch(row, c);
    k.convert(v);
}

// The chunk dequantizer the kernels use per type: the vector one where there is one, else the generic one.
#define DQ_FAST_f32 dq32_f32
#define DQ_FAST_f16 dq32_f16
#define DQ_FAST_bf16 dq32_bf16
#define DQ_FAST_q4_0 dq32_q4_0
#define DQ_FAST_q4_1 dq32_q4_1
#define DQ_FAST_q5_0 dq32_q5_0
#define DQ_FAST_q5_1 dq32_q5_1
#define DQ_FAST_q8_0 dq32_q8_0
#define DQ_FAST_q2_k dq32_q2_k
#define DQ_FAST_q3_k dq32_q3_k
#define DQ_FAST_q4_k dq32_vec_q4_k
#define DQ_FAST_q5_k dq32_q5_k
#define DQ_FAST_q6_k dq32_q6_k

// One instantiation per type: the kernels below are generated for each (name, dequantizer) pair.
#define STRATA_FOR_EACH_QTYPE(X) \
    X(f32, dq32_f32)             \
    X(f16, dq32_f16)             \
    X(bf16, dq32_bf16)           \
    X(q4_0, dq32_q4_0)           \
    X(q4_1, dq32_q4_1)           \
    X(q5_0, dq32_q5_0)           \
    X(q5_1, dq32_q5_1)           \
    X(q8_0, dq32_q8_0)           \
    X(q2_k, dq32_q2_k)           \
    X(q3_k, dq32_q3_k)           \
    X(q4_k, dq32_q4_k)           \
    X(q5_k, dq32_q5_k)           \
    X(q6_k, dq32_q6_k)
