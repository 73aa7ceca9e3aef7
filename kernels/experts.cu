// The VRAM expert cache's device side (DESIGN.md section 3, "Expert cache"): at a decode step (of one token, or of
// several sequences' tokens), a MoE layer's experts are mapped to cache slots by the device's copy of the slot
// table, and its misses are copied into VRAM from the page-locked host arena, read in place over the link, with no
// host round trip: a step of one token stays one CUDA graph (backend/cuda/experts.rs, DeviceTable, keeps the host's
// bookkeeping in step with it).
//
// Codes of the lookup log (expert_lookup's log[2 j + 1]): a hit's slot, an admission's slot | LOOKUP_ADMITTED,
// LOOKUP_STAGED (read for this step alone, into a staging slot), LOOKUP_CPU (computed by the CPU: cpu_join),
// LOOKUP_REPEAT (an expert an earlier routing slot of the layer-step looked up already: read where that one is), or
// LOOKUP_BAD (an expert id outside the model: nothing is looked up or fetched, and the host fails the step when it
// reads the log). experts.rs mirrors these.
#define LOOKUP_ADMITTED 0x80000000u
#define LOOKUP_STAGED 0xFFFFFFFFu
#define LOOKUP_BAD 0xFFFFFFFEu
#define LOOKUP_CPU 0xFFFFFFFDu
// LOOKUP_PREFETCHED: a miss read from the prefetch's staging slot (expert_prefetch). The prefetch log's codes besides
// an admission's slot | LOOKUP_ADMITTED: PREFETCH_CACHED, PREFETCH_SKIPPED, PREFETCH_STAGED (see expert_prefetch).
#define LOOKUP_PREFETCHED 0xFFFFFFF9u
#define LOOKUP_REPEAT 0xFFFFFFF8u
// LOOKUP_NO_ROOM: a miss past the staging slots (the host never runs such a step on the device's table).
#define LOOKUP_NO_ROOM 0xFFFFFFF7u
#define PREFETCH_CACHED 0xFFFFFFFCu
#define PREFETCH_SKIPPED 0xFFFFFFFBu
#define PREFETCH_STAGED 0xFFFFFFFAu

// The CPU's share of a layer's misses (join.rs mirrors these word offsets). `join_host` is mapped page-locked
// memory: JOIN_REQ the request's sequence number (written last), JOIN_LAYER, JOIN_JOBS, then at JOIN_PAIRS
// (expert, token) per job; the CPU writes JOIN_DONE (the sequence number it finished) and the GPU JOIN_FAILED
// (one it stopped waiting for). `join_dev` is device memory: [0] the last sequence number, [1] the one cpu_join
// waits for (0: none this layer-step), [2] jobs, [3 + q] job q's routing slot.
#define JOIN_REQ 0
#define JOIN_LAYER 1
#define JOIN_JOBS 2
#define JOIN_DONE 32
#define JOIN_FAILED 64
#define JOIN_PAIRS 96

// Of the n routing slots' flags (thread j's is `flag`), how many are set before slot j and in all, through `shared`
// ([blockDim.x], n <= blockDim.x); every thread of the block calls it, and it ends with a barrier.
__device__ __forceinline__ void count_flags(bool flag, int n, u32* shared, u32* before, u32* total) {
    shared[threadIdx.x] = flag;
    __syncthreads();
    u32 b = 0, c = 0;
    for (int i = 0; i < n; ++i) {
        b += i < (int)threadIdx.x ? shared[i] : 0;
        c += shared[i];
    }
    *before = b;
    *total = c;
}

// Routing slot j of a step's n routing slots (n_tok tokens x top-k, in token order) at layer `layer` (its expert
// ids[j], j < n) to the slot the expert kernels read: table[layer * n_expert + e] when cached. An expert an earlier
// routing slot of the step chose too is looked up once, by the first: a later one reads where it does, with code
// LOOKUP_REPEAT. Of the layer-step's m (distinct) misses, the CPU computes the last cpu_take[m] in routing order
// (cpu_take null: none; steps of one token only); the others, in routing order, take the next of the host's free
// slots (free_slots[ctl[1]], ctl[1] + 1, ... while below ctl[0]), the first `cap` of them (the upload cap per layer
// and step), and enter the table; the rest are read, in order, into staging slots staging, staging + 1, ... for
// this step alone (n_staging of them: the host runs a step here only when its distinct experts fit them; past
// them, LOOKUP_NO_ROOM: not fetched, read from the first staging slot, and the host fails the step). Every other
// miss the link carries joins the fetch list (fetch[0] misses, then (expert, slot) pairs, in routing order) for
// expert_fetch. Writes slot_ids[j]; the same split in
// two, for computing the hits while the misses are fetched: slot_ids[n + j] the hits' slots (MOE_SKIP for a
// miss), slot_ids[2 n + j] the fetched misses' (MOE_SKIP for a hit); a CPU job is MOE_SKIP in all three. And the
// log: log[2 j] = e, log[2 j + 1] = its code. With CPU jobs, the token's activations x ([n_embd]) are copied to
// join_x (mapped), the jobs published in join_host and their routing slots in join_dev (see JOIN_*). pf_list
// (expert_prefetch's, steps of one token only: n = k) or null. One block of at least n threads (n <= 1024),
// thread j for routing slot j: the outcome is the one a single thread taking the slots in routing order would
// reach, which is the order the host replays the log in.
extern "C" __global__ void expert_lookup(const u32* __restrict__ ids, int n, int layer, int n_expert, int* table,
                                         const u32* __restrict__ free_slots, u32* ctl, u32* slot_ids,
                                         u32* __restrict__ fetch, u32* __restrict__ log, int staging, int n_staging,
                                         int cap, const int* __restrict__ cpu_take, const float* __restrict__ x,
                                         int n_embd, u32* join_dev, u32* join_host, float* join_x, u32* pf_list,
                                         int pf_staging) {
    pdl_enter();
    __shared__ u32 missed[1024], sid[1024];
    int j = threadIdx.x;
    bool here = j < n;
    u32 e = here ? ids[j] : 0;
    sid[j] = e;
    __syncthreads();
    // The first routing slot with this expert looks it up.
    int first = j;
    for (int i = 0; here && i < j; ++i)
        if (sid[i] == e) {
            first = i;
            break;
        }
    bool repeat = first != j;
    bool bad = e >= (u32)n_expert;
    int* t = table + (long long)layer * n_expert + (bad ? 0 : e);
    bool looks = here && !bad && !repeat;
    int s = looks ? *t : 0;
    bool miss = looks && s < 0;
    // A miss expert_prefetch copied into a prefetch staging slot for this layer is read there, like a hit; the
    // slots the prefetch admitted for this layer count against its cap.
    bool prefetched = false;
    bool pf_here = pf_list && pf_list[0] == (u32)layer;
    if (pf_here) {
        u32 pre = pf_list[1 + n];
        cap = pre >= (u32)cap ? 0 : cap - (int)pre;
    }
    if (miss && pf_here)
        for (int i = 0; i < n; ++i)
            if (pf_list[1 + i] == e) {
                s = pf_staging + i;
                prefetched = true;
                miss = false;
            }
    u32 before, total;
    count_flags(miss, n, missed, &before, &total);
    // Every thread has read pf_list: it names this layer's prefetch no more.
    if (j == 0 && pf_list) pf_list[0] = MOE_SKIP;
    u32 avail = ctl[0], taken = ctl[1];
    u32 on_cpu = 0;
    if (cpu_take) {
        int c = cpu_take[total];
        on_cpu = c <= 0 ? 0 : ((u32)c > total ? total : (u32)c);
    }
    u32 linked = total - on_cpu;  // misses the link carries
    // The first `admit` of them take free slots; the others staging slots.
    u32 room = avail > taken ? avail - taken : 0;
    u32 admit = cap <= 0 ? 0 : min(linked, min((u32)cap, room));
    __syncthreads();  // every thread has read ctl[1] before thread 0 moves it
    if (on_cpu > 0)
        for (int i = j; i < n_embd; i += blockDim.x) join_x[i] = x[i];
    if (here) {
        u32 code = prefetched ? LOOKUP_PREFETCHED : (u32)s;
        bool cpu = miss && before >= linked;
        if (repeat) {
            code = LOOKUP_REPEAT;
        } else if (bad) {
            s = staging;
            code = LOOKUP_BAD;
        } else if (cpu) {
            u32 q = before - linked;
            join_host[JOIN_PAIRS + 2 * q] = e;
            join_host[JOIN_PAIRS + 2 * q + 1] = 0;
            join_dev[3 + q] = (u32)j;
            code = LOOKUP_CPU;
        } else if (miss) {
            if (before < admit) {
                s = (int)free_slots[taken + before];
                *t = s;
                code = (u32)s | LOOKUP_ADMITTED;
            } else if ((int)(before - admit) < n_staging) {
                s = staging + (int)(before - admit);
                code = LOOKUP_STAGED;
            } else {
                s = staging;
                code = LOOKUP_NO_ROOM;
            }
            if (code != LOOKUP_NO_ROOM) {
                fetch[1 + 2 * before] = e;
                fetch[2 + 2 * before] = (u32)s;
            }
        }
        if (!repeat) {
            slot_ids[j] = cpu ? MOE_SKIP : (u32)s;
            slot_ids[n + j] = miss ? MOE_SKIP : (u32)s;
            slot_ids[2 * n + j] = miss && !cpu ? (u32)s : MOE_SKIP;
        }
        log[2 * j] = e;
        log[2 * j + 1] = code;
    }
    // The CPU reads the activations and jobs once it sees the request's number: they reach host memory first.
    if (on_cpu > 0) __threadfence_system();
    __syncthreads();
    // A repeat reads where its first routing slot does (written before the barrier).
    if (here && repeat)
        for (int p = 0; p < 3; ++p) slot_ids[p * n + j] = slot_ids[p * n + first];
    if (j == 0) {
        ctl[1] = taken + admit;
        // The misses past the staging slots are the last ones: left out.
        fetch[0] = min(linked, admit + (u32)n_staging);
        if (on_cpu > 0) {
            u32 seq = join_dev[0] + 1;
            if (seq == 0) seq = 1;
            join_dev[0] = seq;
            join_dev[1] = seq;
            join_dev[2] = on_cpu;
            join_host[JOIN_LAYER] = (u32)layer;
            join_host[JOIN_JOBS] = on_cpu;
            __threadfence_system();
            *(volatile u32*)(join_host + JOIN_REQ) = seq;
        } else if (cpu_take) {
            join_dev[1] = 0;
        }
    }
}

// The prefetch of a decode step's next MoE layer (`layer`): the experts its router picks from the current layer's
// input (`ids`, k of them: router_route with the next layer's router) that are not cached take the next of the
// host's free slots, as expert_lookup's admissions do and under the same cap, enter the table, and join the
// prefetch's fetch list (fetch[0] experts, then (expert, slot) pairs) that expert_fetch copies in on the side stream
// while the step goes on; the next layer's lookup then finds them as hits. The others (no free slot, or past the
// cap) go to prefetch staging slot pf_staging + j when there is one (pf_staging >= 0), named in pf_list ([0] the
// layer, [1 + j] the expert or MOE_SKIP, [1 + k] the slots admitted, which count against the layer's cap), where
// the lookup finds them. log[2 j] = e and log[2 j + 1] = the slot |
// LOOKUP_ADMITTED, PREFETCH_STAGED, PREFETCH_CACHED (cached already) or PREFETCH_SKIPPED (nowhere to put it, or an
// id outside the model, or past the first pf_max uncached ones). One block of 64 threads, thread j for routing slot
// j (k <= 64), in the order a single thread taking the slots in routing order would reach, which is the order the
// host replays the log in.
extern "C" __global__ void expert_prefetch(const u32* __restrict__ ids, int k, int layer, int n_expert, int* table,
                                           const u32* __restrict__ free_slots, u32* ctl, u32* __restrict__ fetch,
                                           u32* __restrict__ log, int cap, u32* __restrict__ pf_list,
                                           int pf_staging, int pf_max) {
    pdl_enter();
    __shared__ u32 missed[64];
    int j = threadIdx.x;
    bool here = j < k;
    u32 e = here ? ids[j] : 0;
    bool bad = e >= (u32)n_expert;
    int* t = table + (long long)layer * n_expert + (bad ? 0 : e);
    bool miss = here && !bad && *t < 0;
    u32 before, total;
    count_flags(miss, k, missed, &before, &total);
    u32 avail = ctl[0], taken = ctl[1];
    __syncthreads();  // every thread has read ctl[1] before thread 0 moves it
    // The first pf_max of them (the router's surest) at most; the others are skipped.
    if (total > (u32)pf_max) total = (u32)pf_max;
    bool over = miss && before >= total;
    miss = miss && !over;
    u32 admitted = total < (u32)cap ? total : (u32)cap;
    if (taken + admitted > avail) admitted = avail > taken ? avail - taken : 0;
    if (here) {
        u32 code = bad || over ? PREFETCH_SKIPPED : PREFETCH_CACHED;
        u32 staged = MOE_SKIP;
        if (miss && before < admitted) {
            u32 s = free_slots[taken + before];
            *t = (int)s;
            fetch[1 + 2 * before] = e;
            fetch[2 + 2 * before] = s;
            code = s | LOOKUP_ADMITTED;
        } else if (miss && pf_staging >= 0) {
            fetch[1 + 2 * before] = e;
            fetch[2 + 2 * before] = (u32)(pf_staging + j);
            staged = e;
            code = PREFETCH_STAGED;
        } else if (miss) {
            code = PREFETCH_SKIPPED;
        }
        pf_list[1 + j] = staged;
        log[2 * j] = e;
        log[2 * j + 1] = code;
    }
    __syncthreads();
    if (j == 0) {
        ctl[1] = taken + admitted;
        fetch[0] = pf_staging >= 0 ? total : admitted;
        pf_list[0] = (u32)layer;
        pf_list[1 + k] = admitted;  // the layer's lookup admits at most cap less these
    }
}

// Waits for the CPU's share of the layer-step's misses (expert_lookup published them; join.rs computes them) and
// writes its rows into the experts' outputs: row q of `rows` (mapped, [jobs][n_embd], the CPU's down projections)
// to dp[join_dev[3 + q]] ([k][n_embd]; rows 16-byte aligned). Nothing when the step gave the CPU no job
// (join_dev[1] 0). Thread 0 of each block polls join_host[JOIN_DONE]; past timeout_ns it writes the sequence number
// to join_host[JOIN_FAILED] (the host fails the step) and leaves the rows as they are. Grid (any), block 256.
extern "C" __global__ void cpu_join(const u32* __restrict__ join_dev, u32* join_host, const float* rows,
                                    float* __restrict__ dp, int n_embd, long long timeout_ns) {
    pdl_enter();
    __shared__ int ok;
    u32 want = join_dev[1];
    if (want == 0) return;
    if (threadIdx.x == 0) {
        unsigned long long t0, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        ok = 1;
        while (*(volatile u32*)(join_host + JOIN_DONE) != want) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if ((long long)(now - t0) > timeout_ns) {
                *(volatile u32*)(join_host + JOIN_FAILED) = want;
                ok = 0;
                break;
            }
            __nanosleep(256);
        }
        __threadfence_system();
    }
    __syncthreads();
    if (!ok) return;
    u32 n = join_dev[2];
    long long stride = (long long)gridDim.x * blockDim.x;
    long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // Loads not from any cache (the CPU wrote the rows after the kernel began), 16 bytes each when rows allow:
    // one round trip over the link per thread for a layer's rows.
    if ((n_embd & 3) == 0) {
        int w = n_embd / 4;
        for (long long i = first; i < (long long)n * w; i += stride) {
            long long q = i / w, c = i % w;
            float4 v;
            asm volatile("ld.global.cv.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                         : "l"(rows + 4 * i));
            ((float4*)(dp + (long long)join_dev[3 + q] * n_embd))[c] = v;
        }
    } else {
        for (long long i = first; i < (long long)n * n_embd; i += stride) {
            long long q = i / n_embd, c = i % n_embd;
            float v;
            asm volatile("ld.global.cv.f32 %0, [%1];" : "=f"(v) : "l"(rows + i));
            dp[(long long)join_dev[3 + q] * n_embd + c] = v;
        }
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
