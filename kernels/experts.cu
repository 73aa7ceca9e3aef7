// The VRAM expert cache's device side (DESIGN.md section 3, "Expert cache"): at a decode step of one token, a MoE
// layer's experts are mapped to cache slots by the device's copy of the slot table, and its misses are copied into
// VRAM from the page-locked host arena, read in place over the link, with no host round trip: the step stays one
// CUDA graph (backend/cuda/experts.rs, DeviceTable, keeps the host's bookkeeping in step with it).
//
// Codes of the lookup log (expert_lookup's log[2 j + 1]): a hit's slot, an admission's slot | LOOKUP_ADMITTED,
// LOOKUP_STAGED (read for this step alone, into a staging slot), or LOOKUP_BAD (an expert id outside the model:
// nothing is looked up or fetched, and the host fails the step when it reads the log). experts.rs mirrors these.
#define LOOKUP_ADMITTED 0x80000000u
#define LOOKUP_STAGED 0xFFFFFFFFu
#define LOOKUP_BAD 0xFFFFFFFEu

// Routing slot j of one token at layer `layer` (its expert ids[j], j < k) to the slot the expert kernels read:
// table[layer * n_expert + e] when cached. The misses, in routing order, take the next of the host's free slots
// (free_slots[ctl[1]], ctl[1] + 1, ... while below ctl[0]), the first `cap` of them (the upload cap per layer and
// step), and enter the table; any other miss is read into staging slot `staging + j` for this step alone. Every
// miss joins the fetch list (fetch[0] misses, then (expert, slot) pairs, in routing order) for expert_fetch.
// Writes slot_ids[j]; the same split in two, for computing the hits while the misses are fetched: slot_ids[k + j]
// the hits' slots (MOE_SKIP for a miss), slot_ids[2 k + j] the misses' (MOE_SKIP for a hit); and the log:
// log[2 j] = e, log[2 j + 1] = its code. One block of 64 threads, thread j for routing slot j (k <= 64): the
// outcome is the one a single thread taking the slots in routing order would reach, which is the order the host
// replays the log in.
extern "C" __global__ void expert_lookup(const u32* __restrict__ ids, int k, int layer, int n_expert, int* table,
                                         const u32* __restrict__ free_slots, u32* ctl, u32* __restrict__ slot_ids,
                                         u32* __restrict__ fetch, u32* __restrict__ log, int staging,
                                         int cap) {
    pdl_enter();
    __shared__ u32 missed[64];
    int j = threadIdx.x;
    bool here = j < k;
    u32 e = here ? ids[j] : 0;
    bool bad = e >= (u32)n_expert;
    int* t = table + (long long)layer * n_expert + (bad ? 0 : e);
    int s = here && !bad ? *t : 0;
    bool miss = here && !bad && s < 0;
    missed[j] = miss;
    __syncthreads();
    u32 before = 0, total = 0;
    for (int i = 0; i < k; ++i) {
        before += i < j ? missed[i] : 0;
        total += missed[i];
    }
    u32 avail = ctl[0], taken = ctl[1];
    __syncthreads();  // every thread has read ctl[1] before thread 0 moves it
    if (!here) return;
    u32 code = (u32)s;
    if (bad) {
        s = staging + j;
        code = LOOKUP_BAD;
    } else if (miss) {
        if ((int)before < cap && taken + before < avail) {
            s = (int)free_slots[taken + before];
            *t = s;
            code = (u32)s | LOOKUP_ADMITTED;
        } else {
            s = staging + j;
            code = LOOKUP_STAGED;
        }
        fetch[1 + 2 * before] = e;
        fetch[2 + 2 * before] = (u32)s;
    }
    slot_ids[j] = (u32)s;
    slot_ids[k + j] = miss ? MOE_SKIP : (u32)s;
    slot_ids[2 * k + j] = miss ? (u32)s : MOE_SKIP;
    log[2 * j] = e;
    log[2 * j + 1] = code;
    if (j == 0) {
        u32 admitted = (int)total < cap ? total : (u32)cap;
        ctl[1] = taken + admitted < avail ? taken + admitted : (taken > avail ? taken : avail);
        fetch[0] = total;
    }
}

// Copies the fetch list's experts (expert_lookup) from host memory into their slots: expert e's matrix m
// (0 gate, 1 up, 2 down: blockIdx.y) is bytes[m] at src[m] + e * bytes[m] (the page-locked arena, mapped), copied to
// pool + slot * slot_bytes + off[m]. The blocks of a matrix stride over 16-byte words four at a time (enough loads
// in flight to keep the link busy) when its size and addresses are multiples of 16 (bit m of vec16), else over
// bytes.
// Grid (any, 3), block 256.
extern "C" __global__ void expert_fetch(const u32* __restrict__ fetch, const u8* src_g, const u8* src_u,
                                        const u8* src_d, long long bytes_g, long long bytes_u, long long bytes_d,
                                        u8* pool, long long slot_bytes, long long off_g, long long off_u,
                                        long long off_d, int vec16) {
    pdl_enter();
    int mat = blockIdx.y;
    const u8* src = mat == 0 ? src_g : mat == 1 ? src_u : src_d;
    long long bytes = mat == 0 ? bytes_g : mat == 1 ? bytes_u : bytes_d;
    long long off = mat == 0 ? off_g : mat == 1 ? off_u : off_d;
    u32 m = fetch[0];
    long long stride = (long long)gridDim.x * blockDim.x;
    long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (u32 q = 0; q < m; ++q) {
        u32 e = fetch[1 + 2 * q], slot = fetch[2 + 2 * q];
        const u8* s = src + (long long)e * bytes;
        u8* d = pool + (long long)slot * slot_bytes + off;
        if ((vec16 >> mat) & 1) {
            const uint4* s4 = (const uint4*)s;
            uint4* d4 = (uint4*)d;
            long long n = bytes / 16;
            long long i = first;
            for (; i + 3 * stride < n; i += 4 * stride) {
                uint4 a = s4[i], b = s4[i + stride], c = s4[i + 2 * stride], w = s4[i + 3 * stride];
                d4[i] = a;
                d4[i + stride] = b;
                d4[i + 2 * stride] = c;
                d4[i + 3 * stride] = w;
            }
            for (; i < n; i += stride) d4[i] = s4[i];
        } else {
            for (long long i = first; i < bytes; i += stride) d[i] = s[i];
        }
    }
}
