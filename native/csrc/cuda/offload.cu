// The GPU side of the offload runtime's decode step: expert-cache decisions made on the device,
// so a whole decode step can be captured in one CUDA graph with no host round trip.
//
//   offload_step_begin   step counter += 1 (first node of a captured step)
//   offload_plan         per MoE layer: hits / PCIe fetches / CPU misses, residency-table
//                        updates (decayed-frequency + recency replacement), CPU work list + hand-off
//   offload_fetch        copies the chosen experts from the page-locked host bank into their
//                        new cache slots (zero-copy reads over PCIe, ~45-51 GB/s measured)
//   offload_wait_add     waits (bounded) for the CPU worker's result and adds it to the output
//   offload_link_mark / offload_link_hold   the emulated slower link (--link-gbps) around a copy
//   offload_prefetch     before a layer runs: slots for the experts it is guessed to use (the next
//                        layer's router applied to the current hidden state), filled by
//                        offload_fetch on a side stream while the current layer computes
//
// Memory (all addresses from the caller; nothing is allocated here): ft::CacheTables on the
// device, ft::Exchange in page-locked host memory, the fetch list in device scratch.
// Every entry point is asynchronous on the given stream and capturable.
#include <cuda_runtime.h>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "offload_api.h"

namespace ft {
namespace {

constexpr int kPlanThreads = 256;
constexpr int kMaxSel = kMaxSelections;  // T * K selections per step (offload_exchange.h)

__global__ void step_begin_kernel(int32_t* step) { *step += 1; }

// One layer's rows of the residency tables.
struct LayerTables {
    int32_t *soe, *eos, *last, *freq, *stats, *score, *seen;
    const int32_t *pinned, *decay;
    int n_slots, E;
};

__device__ LayerTables layer_tables(const CacheTables& tab, int layer) {
    const size_t E = tab.n_experts, S = tab.max_slots;
    return {tab.slot_of_expert + layer * E, tab.expert_of_slot + layer * S,
            tab.slot_last_use + layer * S,  tab.expert_freq + layer * E,
            tab.stats + (size_t)layer * kStatsCols, tab.expert_score + layer * E,
            tab.expert_seen + layer * E, tab.slot_pinned + layer * S, tab.score_decay,
            tab.n_slots[layer], tab.n_experts};
}

// Expert e's score at `step` (the one definition: offload_exchange.h).
__device__ __forceinline__ uint32_t decayed_score(const LayerTables& t, int32_t e, int32_t step) {
    return ft::decayed_score(t.score[e], t.seen[e], step, t.decay);
}

// Block-wide: key[s] = how evictable slot s is, smaller first: free slots, then the expert of
// smallest score, then the least recently used; LLONG_MAX (never) for slots used this step or
// pinned. Returns how many evictable slots this thread saw.
__device__ int slot_keys(const LayerTables& t, int32_t step, long long* key) {
    int n = 0;
    for (int s = threadIdx.x; s < t.n_slots; s += blockDim.x) {
        const int32_t old = t.eos[s];
        const bool never = t.pinned[s] || t.last[s] >= step;
        key[s] = never ? LLONG_MAX
               : old < 0 ? LLONG_MIN
                         : victim_key(decayed_score(t, old, step), t.last[s]);
        n += !never;
    }
    return n;
}

// Warp 0 of the block: gives want[0..n) the slots of smallest key in turn (ties: lower slot),
// evicting their experts, marking them used this step, listing (expert, slot) at list[1 + 2i].
// Stops early when no slot is evictable. Returns the number assigned (every lane).
__device__ int assign_slots(const LayerTables& t, int32_t step, long long* key,
                            const int32_t* want, int n, int32_t* list) {
    const int lane = threadIdx.x & 31;
    int done = 0;
    for (; done < n; ++done) {
        long long best = LLONG_MAX;
        int best_s = INT_MAX;
        for (int s = lane; s < t.n_slots; s += 32)
            if (key[s] < best) { best = key[s]; best_s = s; }
        for (int off = 16; off > 0; off >>= 1) {
            const long long k = __shfl_xor_sync(0xffffffffu, best, off);
            const int ks = __shfl_xor_sync(0xffffffffu, best_s, off);
            if (k < best || (k == best && ks < best_s)) { best = k; best_s = ks; }
        }
        if (best == LLONG_MAX) break;  // every slot is in use this step (or pinned)
        if (lane == 0) {
            const int32_t e = want[done], old = t.eos[best_s];
            if (old >= 0) t.soe[old] = -1;
            t.eos[best_s] = e;
            t.soe[e] = best_s;
            t.last[best_s] = step;
            key[best_s] = LLONG_MAX;
            list[1 + 2 * done] = e;
            list[2 + 2 * done] = best_s;
        }
        __syncwarp();
    }
    return done;
}

// One block; dynamic shared memory: max_slots keys. Per selection in parallel: hit (resident
// before the step, or on this step's guess) or miss; thread 0 orders the unique misses (most frequent
// first) and decides how many to fetch; warp 0 gives those slots; then per selection in
// parallel: the CPU's list and the pair slots.
__global__ void __launch_bounds__(kPlanThreads)
plan_kernel(CacheTables tab, Exchange ex, int layer, const int32_t* __restrict__ ids,
            const float* __restrict__ w, const float* __restrict__ x,
            const int32_t* __restrict__ step_ptr, const float* __restrict__ fetch_fraction,
            const int32_t* __restrict__ guessed /* null, or the count of the experts this step's
                                                   guesses copied into this layer */,
            int32_t* __restrict__ fetch_list /* [1 + 2*kMaxSel]: count, (expert, slot)... */,
            int32_t* __restrict__ pair_slots /* [2][kMaxSel] or null: slot of each selection if
                                                resident before this step | fetched or guessed */) {
    extern __shared__ long long key[];
    __shared__ int32_t sel_expert[kMaxSel], sel_slot[kMaxSel], sel_freq[kMaxSel], miss[kMaxSel];
    __shared__ int8_t sel_kind[kMaxSel];  // 0 hit, 1 hit on a guess (bytes may be in flight),
                                          // 2 miss (fetched now, or the CPU's)
    __shared__ int n_fetch_s, n_cpu_s, hits_s, pf_hits_s;

    const int tid = threadIdx.x;
    const int n_sel = ex.n_tok * ex.top_k;
    const int32_t step = *step_ptr;
    const LayerTables t = layer_tables(tab, layer);
    if (tid == 0) hits_s = pf_hits_s = n_cpu_s = 0;
    if (tid < n_sel) {
        // a resident expert whose slot is already used this step was given it by this step's
        // guesses (offload_prefetch; the plan runs once a layer a step): its copy may be in flight
        const int32_t e = ids[tid], s = t.soe[e];
        sel_expert[tid] = e;
        sel_slot[tid] = s;
        sel_kind[tid] = s < 0 ? 2 : t.last[s] >= step ? 1 : 0;
        atomicAdd(t.freq + e, 1);
        int n = 0, first = tid;   // the first selection of e updates its score, by all of them
        for (int j = 0; j < n_sel; ++j)
            if (ids[j] == e) { ++n; first = min(first, j); }
        if (first == tid) {
            t.score[e] = (int32_t)(decayed_score(t, e, step) + (uint32_t)n * kScoreOne);
            t.seen[e] = step;
        }
    }
    __syncthreads();   // every kind read before any hit is marked used this step
    if (tid < n_sel && sel_kind[tid] != 2) {
        t.last[sel_slot[tid]] = step;
        atomicAdd(&hits_s, 1);
        if (sel_kind[tid] == 1) atomicAdd(&pf_hits_s, 1);
    }
    __syncthreads();
    if (tid < n_sel) sel_freq[tid] = t.freq[sel_expert[tid]];  // after this plan's counts
    slot_keys(t, step, key);                                   // this step's hits are not victims
    __syncthreads();
    if (tid == 0) {
        // unique misses, the most frequently used first (they are the likeliest to hit again)
        int nm = 0;
        int32_t mfreq[kMaxSel];
        for (int i = 0; i < n_sel; ++i) {
            if (sel_kind[i] != 2) continue;
            const int32_t e = sel_expert[i];
            bool seen = false;
            for (int j = 0; j < nm; ++j) seen |= miss[j] == e;
            if (seen) continue;
            int j = nm++;
            for (; j > 0 && mfreq[j - 1] < sel_freq[i]; --j) { miss[j] = miss[j - 1]; mfreq[j] = mfreq[j - 1]; }
            miss[j] = e;
            mfreq[j] = sel_freq[i];
        }
        // The link's share q = fetch_fraction[0] of this layer's expert copies, guesses
        // included: the guesses already crossed it, so q * (nm + g) - g of the misses join them
        // and the CPU takes the rest (link and CPU then finish together). At least
        // fetch_fraction[1] of them: a CPU call on one expert takes as long as the link takes
        // for several.
        // (each step rounded on its own, as plan_reference does: no contraction into an fma)
        const float q = fetch_fraction[0], g = guessed ? (float)*guessed : 0.0f;
        int nf = (int)floorf(__fadd_rn(__fadd_rn(__fmul_rn(q, (float)nm + g), -g), 0.5f));
        nf = max(nf, min(nm, (int)fetch_fraction[1]));
        n_fetch_s = nf < 0 ? 0 : (nf > nm ? nm : nf);
        t.stats[kHits] += hits_s;
        t.stats[kPrefetchHits] += pf_hits_s;
    }
    __syncthreads();
    if (tid < 32) {
        const int fetched = assign_slots(t, step, key, miss, n_fetch_s, fetch_list);
        if (tid == 0) {
            fetch_list[0] = fetched;
            t.stats[kFetched] += fetched;
        }
    }
    __syncthreads();

    int32_t* cpu_ids = ex.cpu_ids + (size_t)layer * ex.max_tok * ex.top_k;
    float* cpu_w = ex.cpu_w + (size_t)layer * ex.max_tok * ex.top_k;
    if (tid < n_sel) {
        const int32_t s = t.soe[sel_expert[tid]];
        const bool cpu = sel_kind[tid] == 2 && s < 0;
        cpu_ids[tid] = cpu ? sel_expert[tid] : -1;
        cpu_w[tid] = w[tid];
        if (cpu) atomicAdd(&n_cpu_s, 1);
        if (pair_slots) {  // row 0 can be computed at once; row 1 once the copies have landed
            pair_slots[tid] = sel_kind[tid] == 0 ? s : -1;
            pair_slots[kMaxSel + tid] = sel_kind[tid] != 0 ? s : -1;
        }
    }
    __syncthreads();
    if (tid == 0) {
        t.stats[kCpu] += n_cpu_s;
        tab.cpu_pending[layer] = n_cpu_s;
    }
    // hand the layer input to the CPU (only when it has work: the copy crosses PCIe)
    if (n_cpu_s > 0) {
        const int n_x = ex.n_tok * ex.hidden;
        float* xh = ex.x_host + (size_t)layer * ex.max_tok * ex.hidden;
        for (int i = tid; i < n_x; i += kPlanThreads) xh[i] = x[i];
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0) *(volatile int32_t*)(ex.gpu_flag + layer) = step;
}

// One block; dynamic shared memory: max_slots keys. Slots for the guessed experts of a layer that
// are not resident (at most kMaxSel, duplicates once), marked used this step so the layer's own
// plan cannot evict them; the list (count, (expert, slot)...) is what offload_fetch copies and
// what the layer's plan counts hits against. `reserve` evictable slots are left for the layer's
// own misses, so a guess never sends a miss to the CPU for want of a slot.
__global__ void __launch_bounds__(kPlanThreads)
prefetch_kernel(CacheTables tab, int layer, const int32_t* __restrict__ guess, int n_guess,
                int reserve, const int32_t* __restrict__ step_ptr, int32_t* __restrict__ list) {
    extern __shared__ long long key[];
    __shared__ int32_t cand[kMaxSel], want[kMaxSel];
    __shared__ int n_want, n_free;
    const int tid = threadIdx.x;
    const int32_t step = *step_ptr;
    const LayerTables t = layer_tables(tab, layer);
    if (tid == 0) n_free = 0;
    if (tid < n_guess) {  // a candidate: a valid expert that is not resident
        const int32_t e = guess[tid];
        cand[tid] = e >= 0 && e < t.E && t.soe[e] < 0 ? e : -1;
    }
    __syncthreads();
    const int mine = slot_keys(t, step, key);
    atomicAdd(&n_free, mine);
    __syncthreads();
    if (tid == 0) {
        int n = 0;
        const int cap = n_free - reserve < kMaxSel ? n_free - reserve : kMaxSel;
        for (int i = 0; i < n_guess && n < cap; ++i) {
            const int32_t e = cand[i];
            if (e < 0) continue;
            bool seen = false;
            for (int j = 0; j < n; ++j) seen |= want[j] == e;
            if (!seen) want[n++] = e;
        }
        n_want = n;
    }
    __syncthreads();
    if (tid < 32) {
        const int done = assign_slots(t, step, key, want, n_want, list);
        if (tid == 0) {
            list[0] = done;
            t.stats[kPrefetched] += done;
        }
    }
}

// A small grid (`blocks`, 16 by default) walks all (entry, 16-byte piece) pairs, each thread
// keeping kFetchUnroll loads in flight: enough outstanding PCIe reads to fill the link (256 KiB
// with 16 blocks) while occupying few SMs, so a copy on a side stream leaves the compute kernels
// room (with 128 blocks decode was 20% slower).
constexpr int kFetchUnroll = 4;

__global__ void __launch_bounds__(256)
fetch_kernel(const int32_t* __restrict__ fetch_list, const uint4* __restrict__ host_bank,
             uint4* __restrict__ pool, int64_t expert_bytes, int64_t slot_bytes) {
    const int64_t n16 = expert_bytes / 16, total = (int64_t)fetch_list[0] * n16;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t base = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; base < total;
         base += stride * kFetchUnroll) {
        uint4 v[kFetchUnroll];
        int64_t dst[kFetchUnroll];
#pragma unroll
        for (int u = 0; u < kFetchUnroll; ++u) {
            const int64_t i = base + u * stride;
            dst[u] = -1;
            if (i < total) {
                const int64_t f = i / n16, off = i - f * n16;
                const int64_t e = fetch_list[1 + 2 * f], s = fetch_list[2 + 2 * f];
                v[u] = host_bank[e * n16 + off];
                dst[u] = s * (slot_bytes / 16) + off;
            }
        }
#pragma unroll
        for (int u = 0; u < kFetchUnroll; ++u)
            if (dst[u] >= 0) pool[dst[u]] = v[u];
    }
}

// grid (T): waits for the CPU's result for this layer, then y[t] += y_host[t]; returns at once
// when the plan gave the CPU nothing (the worker still answers, nobody waits for it).
__global__ void wait_add_kernel(Exchange ex, int layer, const int32_t* __restrict__ step_ptr,
                                const int32_t* __restrict__ cpu_pending, float* __restrict__ y,
                                int64_t timeout_ns, int32_t* error_flag) {
    __shared__ int ok;
    if (cpu_pending[layer] == 0) return;
    const int32_t step = *step_ptr;
    if (threadIdx.x == 0) {
        volatile int32_t* flag = ex.cpu_flag + layer;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        ok = 1;
        while (*flag < step) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if ((long long)(t - t0) > timeout_ns) { ok = 0; atomicExch(error_flag, layer + 1); break; }
        }
        __threadfence_system();
    }
    __syncthreads();
    if (!ok) return;
    const int t = blockIdx.x;
    const volatile float* yh = ex.y_host + ((size_t)layer * ex.max_tok + t) * ex.hidden;
    float* yt = y + (size_t)t * ex.hidden;
    for (int i = threadIdx.x; i < ex.hidden; i += blockDim.x) yt[i] += yh[i];
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void link_mark_kernel(unsigned long long* clock, int which) {
    clock[kLinkMark + which] = global_ns();
}

// One thread: books the copy's bytes on the emulated link (from its mark, or once the link is
// free if a copy booked earlier still holds it) and spins until the booking ends.
__global__ void link_hold_kernel(unsigned long long* clock, int which, const int32_t* count,
                                 int64_t bytes_each) {
    const long long n = count ? max(*count, 0) : 1;
    const unsigned long long bytes = (unsigned long long)(n * bytes_each);
    if (bytes == 0) return;
    const double ns_per_byte = __longlong_as_double((long long)clock[kLinkNsPerByte]);
    const unsigned long long mark = clock[kLinkMark + which];
    const unsigned long long need = (unsigned long long)(double(bytes) * ns_per_byte);
    unsigned long long seen, end, old = atomicAdd(clock + kLinkFreeAt, 0ull);
    do {
        seen = old;
        end = max(seen, mark) + need;
        old = atomicCAS(clock + kLinkFreeAt, seen, end);
    } while (old != seen);
    atomicAdd(clock + kLinkBytes, bytes);
    while (global_ns() < end) __nanosleep(256);
}

}  // namespace

// ---- entry points (declared in offload_api.h, wrapped by bindings_cuda.cpp) ----------------------
namespace cuda {
namespace {
void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
// dynamic shared memory of the plan and prefetch kernels: one eviction key per slot
size_t key_bytes(const CacheTables& tab) {
    if (tab.max_slots < 0 || tab.max_slots > 6144)
        throw std::invalid_argument("offload: at most 6144 cache slots a layer (48 KB of keys)");
    return size_t(tab.max_slots) * sizeof(long long);
}
}  // namespace

void offload_step_begin(int32_t* step, uintptr_t stream) {
    step_begin_kernel<<<1, 1, 0, as_stream(stream)>>>(step);
    check(cudaGetLastError(), "offload_step_begin");
}

void offload_plan(const CacheTables& tab, const Exchange& ex, int layer, const int32_t* ids,
                  const float* w, const float* x, const int32_t* step, const float* fetch_fraction,
                  const int32_t* guessed, int32_t* fetch_list, int32_t* pair_slots, uintptr_t stream) {
    if (ex.n_tok < 1 || ex.n_tok * ex.top_k > kMaxSel || ex.n_tok > ex.max_tok)
        throw std::invalid_argument("offload_plan: n_tok * top_k must be in [1, 64] and n_tok <= max_tok");
    plan_kernel<<<1, kPlanThreads, key_bytes(tab), as_stream(stream)>>>(tab, ex, layer, ids, w, x, step,
                                                           fetch_fraction, guessed, fetch_list, pair_slots);
    check(cudaGetLastError(), "offload_plan");
}

void offload_prefetch(const CacheTables& tab, int layer, const int32_t* guess, int n_guess,
                      int reserve, const int32_t* step, int32_t* list, uintptr_t stream) {
    if (n_guess < 0 || n_guess > kMaxSel || reserve < 0)
        throw std::invalid_argument("offload_prefetch: 0..64 guessed experts, reserve >= 0");
    prefetch_kernel<<<1, kPlanThreads, key_bytes(tab), as_stream(stream)>>>(tab, layer, guess,
                                                                             n_guess, reserve, step, list);
    check(cudaGetLastError(), "offload_prefetch");
}

void offload_fetch(const int32_t* fetch_list, const void* host_bank, void* pool,
                   int64_t expert_bytes, int64_t slot_bytes, int max_fetch, int blocks,
                   uintptr_t stream) {
    if (expert_bytes % 16 || slot_bytes % 16 || expert_bytes > slot_bytes || max_fetch < 1 ||
        max_fetch > kMaxSel || blocks < 1 || blocks > 1024)
        throw std::invalid_argument("offload_fetch: sizes must be multiples of 16, expert <= slot, "
                                    "1 <= max_fetch <= 64, 1 <= blocks <= 1024");
    fetch_kernel<<<blocks, 256, 0, as_stream(stream)>>>(
        fetch_list, (const uint4*)host_bank, (uint4*)pool, expert_bytes, slot_bytes);
    check(cudaGetLastError(), "offload_fetch");
}

void offload_link_mark(uint64_t* clock, int which, uintptr_t stream) {
    if (which < 0 || which >= kLinkMarks) throw std::invalid_argument("offload_link_mark: which in [0, 3)");
    link_mark_kernel<<<1, 1, 0, as_stream(stream)>>>(reinterpret_cast<unsigned long long*>(clock), which);
    check(cudaGetLastError(), "offload_link_mark");
}

void offload_link_hold(uint64_t* clock, int which, const int32_t* count, int64_t bytes_each,
                       uintptr_t stream) {
    if (which < 0 || which >= kLinkMarks || bytes_each < 0)
        throw std::invalid_argument("offload_link_hold: which in [0, 3), bytes_each >= 0");
    link_hold_kernel<<<1, 1, 0, as_stream(stream)>>>(reinterpret_cast<unsigned long long*>(clock),
                                                      which, count, bytes_each);
    check(cudaGetLastError(), "offload_link_hold");
}

void offload_wait_add(const Exchange& ex, int layer, const int32_t* step,
                      const int32_t* cpu_pending, float* y, int64_t timeout_ns,
                      int32_t* error_flag, uintptr_t stream) {
    wait_add_kernel<<<ex.n_tok, 256, 0, as_stream(stream)>>>(ex, layer, step, cpu_pending, y,
                                                             timeout_ns, error_flag);
    check(cudaGetLastError(), "offload_wait_add");
}

void pin_host(void* p, size_t nbytes) {
    const cudaError_t e = cudaHostRegister(p, nbytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e != cudaSuccess) cudaGetLastError();
    check(e, "cudaHostRegister (page-locking host memory)");
    void* dev = nullptr;
    check(cudaHostGetDevicePointer(&dev, p, 0), "cudaHostGetDevicePointer");
    if (dev != p) {  // the kernels use host addresses directly (unified virtual addressing)
        cudaHostUnregister(p);
        throw std::runtime_error("this GPU maps pinned host memory at another address (no UVA)");
    }
}

void unpin_host(void* p) {
    const cudaError_t e = cudaHostUnregister(p);
    if (e != cudaSuccess) cudaGetLastError();  // not sticky: do not let a later launch report it
    check(e, "cudaHostUnregister");
}

}  // namespace cuda
}  // namespace ft
