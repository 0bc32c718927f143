// The GPU side of the offload runtime's decode step: expert-cache decisions made on the device,
// so a whole decode step can be captured in one CUDA graph with no host round trip.
//
//   offload_step_begin   step counter += 1 (first node of a captured step)
//   offload_plan         per MoE layer: hits / PCIe fetches / CPU misses, residency-table
//                        updates (recency + frequency replacement), CPU work list + hand-off
//   offload_fetch        copies the chosen experts from the page-locked host bank into their
//                        new cache slots (zero-copy reads over PCIe, ~45-51 GB/s measured)
//   offload_wait_add     waits (bounded) for the CPU worker's result and adds it to the output
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
constexpr int kMaxSel = 64;  // T * K selections per step (T <= 8 tokens, K <= 8)

__global__ void step_begin_kernel(int32_t* step) { *step += 1; }

// The slot to evict for a new expert (block-wide; every thread gets the answer): a slot not used
// this step and not pinned; free slots first, then the least recently used, then the least
// frequently used expert. -1 if every slot is in use this step.
__device__ int32_t pick_victim(const int32_t* eos, const int32_t* last, const int32_t* pinned,
                               const int32_t* freq, int n_slots, int32_t step, long long* red_key,
                               int32_t* red_slot) {
    const int tid = threadIdx.x;
    long long best = LLONG_MAX;
    int32_t best_slot = -1;
    for (int s = tid; s < n_slots; s += kPlanThreads) {
        if (pinned[s] || last[s] >= step) continue;
        const int32_t old = eos[s];
        const long long key = old < 0 ? LLONG_MIN : ((long long)last[s] << 32) | (uint32_t)freq[old];
        if (key < best) { best = key; best_slot = s; }
    }
    red_key[tid] = best;
    red_slot[tid] = best_slot;
    __syncthreads();
    for (int half = kPlanThreads / 2; half > 0; half >>= 1) {
        if (tid < half && red_key[tid + half] < red_key[tid]) {
            red_key[tid] = red_key[tid + half];
            red_slot[tid] = red_slot[tid + half];
        }
        __syncthreads();
    }
    const int32_t victim = red_slot[0];
    __syncthreads();  // red_* are reused by the next search
    return victim;
}

// One block. Thread 0 makes the sequential decisions (at most 64 selections); victim searches
// are block-wide reductions over the layer's slots.
__global__ void __launch_bounds__(kPlanThreads)
plan_kernel(CacheTables tab, Exchange ex, int layer, const int32_t* __restrict__ ids,
            const float* __restrict__ w, const float* __restrict__ x,
            const int32_t* __restrict__ step_ptr, const float* __restrict__ fetch_fraction,
            int32_t* __restrict__ fetch_list /* [1 + 2*kMaxSel]: count, (expert, slot)... */,
            const int32_t* __restrict__ prefetched /* this layer's prefetch list, or null */) {
    __shared__ int32_t sel_expert[kMaxSel];
    __shared__ int8_t sel_kind[kMaxSel];     // 0 hit, 1 fetched, 2 cpu
    __shared__ int32_t miss[kMaxSel];        // unique missing experts, best-to-fetch first
    __shared__ int32_t n_fetch_s;
    __shared__ long long red_key[kPlanThreads];
    __shared__ int32_t red_slot[kPlanThreads];

    const int tid = threadIdx.x;
    const int n_sel = ex.n_tok * ex.top_k;
    const int32_t step = *step_ptr;
    const int E = tab.n_experts, S = tab.max_slots;
    int32_t* soe = tab.slot_of_expert + (size_t)layer * E;
    int32_t* eos = tab.expert_of_slot + (size_t)layer * S;
    int32_t* last = tab.slot_last_use + (size_t)layer * S;
    int32_t* pinned = tab.slot_pinned + (size_t)layer * S;
    int32_t* freq = tab.expert_freq + (size_t)layer * E;
    int32_t* stats = tab.stats + (size_t)layer * kStatsCols;
    const int n_slots = tab.n_slots[layer];

    if (tid == 0) {
        int hits = 0, nm = 0, pf_hits = 0;
        const int n_pf = prefetched ? prefetched[0] : 0;
        for (int i = 0; i < n_sel; ++i) {
            const int32_t e = ids[i];
            sel_expert[i] = e;
            freq[e] += 1;
            const int32_t s = soe[e];
            if (s >= 0) {
                last[s] = step;
                sel_kind[i] = 0;
                ++hits;
                for (int j = 0; j < n_pf; ++j) pf_hits += prefetched[1 + 2 * j] == e;
            } else {
                sel_kind[i] = 2;
                bool seen = false;
                for (int j = 0; j < nm; ++j) seen |= miss[j] == e;
                if (!seen) miss[nm++] = e;
            }
        }
        // fetch the most frequently used misses first: they are the likeliest to hit again
        for (int i = 1; i < nm; ++i) {
            const int32_t e = miss[i];
            int j = i - 1;
            while (j >= 0 && freq[miss[j]] < freq[e]) { miss[j + 1] = miss[j]; --j; }
            miss[j + 1] = e;
        }
        // fetch_fraction[0] of the misses over PCIe, and at least fetch_fraction[1] of them: a
        // CPU call on one expert takes as long as the link takes for several
        int nf = (int)floorf(fetch_fraction[0] * nm + 0.5f);
        nf = max(nf, min(nm, (int)fetch_fraction[1]));
        n_fetch_s = nf < 0 ? 0 : (nf > nm ? nm : nf);
        stats[kHits] += hits;
        stats[kPrefetchHits] += pf_hits;
    }
    __syncthreads();

    int fetched = 0;
    for (int f = 0; f < n_fetch_s; ++f) {
        const int32_t victim = pick_victim(eos, last, pinned, freq, n_slots, step, red_key, red_slot);
        if (victim < 0) break;  // every slot is in use this step: the rest go to the CPU
        if (tid == 0) {
            const int32_t e = miss[f], old = eos[victim];
            if (old >= 0) soe[old] = -1;
            eos[victim] = e;
            soe[e] = victim;
            last[victim] = step;
            fetch_list[1 + 2 * f] = e;
            fetch_list[2 + 2 * f] = victim;
        }
        ++fetched;
        __syncthreads();
    }

    int32_t* cpu_ids = ex.cpu_ids + (size_t)layer * ex.max_tok * ex.top_k;
    float* cpu_w = ex.cpu_w + (size_t)layer * ex.max_tok * ex.top_k;
    __shared__ int n_cpu_s;
    if (tid == 0) {
        fetch_list[0] = fetched;
        int n_cpu = 0;
        for (int i = 0; i < n_sel; ++i) {
            const bool cpu = sel_kind[i] == 2 && soe[sel_expert[i]] < 0;
            cpu_ids[i] = cpu ? sel_expert[i] : -1;
            cpu_w[i] = w[i];
            n_cpu += cpu;
        }
        stats[kFetched] += fetched;
        stats[kCpu] += n_cpu;
        tab.cpu_pending[layer] = n_cpu;
        n_cpu_s = n_cpu;
    }
    __syncthreads();
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

// One block: slots for the guessed experts of a layer that are not resident (at most kMaxSel,
// duplicates once), marked used this step so the layer's own plan cannot evict them; the list
// (count, (expert, slot)...) is what offload_fetch copies and what the layer's plan counts hits
// against. `reserve` evictable slots are left for the layer's own misses, so a guess never sends
// a miss to the CPU for want of a slot.
__global__ void __launch_bounds__(kPlanThreads)
prefetch_kernel(CacheTables tab, int layer, const int32_t* __restrict__ guess, int n_guess,
                int reserve, const int32_t* __restrict__ step_ptr, int32_t* __restrict__ list) {
    __shared__ int32_t want[kMaxSel];
    __shared__ int32_t n_want, n_free;
    __shared__ long long red_key[kPlanThreads];
    __shared__ int32_t red_slot[kPlanThreads];
    const int tid = threadIdx.x;
    const int32_t step = *step_ptr;
    const int E = tab.n_experts, S = tab.max_slots;
    int32_t* soe = tab.slot_of_expert + (size_t)layer * E;
    int32_t* eos = tab.expert_of_slot + (size_t)layer * S;
    int32_t* last = tab.slot_last_use + (size_t)layer * S;
    const int32_t* pinned = tab.slot_pinned + (size_t)layer * S;
    const int32_t* freq = tab.expert_freq + (size_t)layer * E;
    const int n_slots = tab.n_slots[layer];
    if (tid == 0) n_free = 0;
    __syncthreads();
    int mine = 0;
    for (int s = tid; s < n_slots; s += kPlanThreads) mine += !pinned[s] && last[s] < step;
    atomicAdd(&n_free, mine);
    __syncthreads();
    if (tid == 0) {
        int n = 0;
        const int cap = n_free - reserve < kMaxSel ? n_free - reserve : kMaxSel;
        for (int i = 0; i < n_guess && n < cap; ++i) {
            const int32_t e = guess[i];
            if (e < 0 || e >= E || soe[e] >= 0) continue;
            bool seen = false;
            for (int j = 0; j < n; ++j) seen |= want[j] == e;
            if (!seen) want[n++] = e;
        }
        n_want = n;
    }
    __syncthreads();
    int done = 0;
    for (int f = 0; f < n_want; ++f) {
        const int32_t victim = pick_victim(eos, last, pinned, freq, n_slots, step, red_key, red_slot);
        if (victim < 0) break;
        if (tid == 0) {
            const int32_t e = want[f], old = eos[victim];
            if (old >= 0) soe[old] = -1;
            eos[victim] = e;
            soe[e] = victim;
            last[victim] = step;
            list[1 + 2 * f] = e;
            list[2 + 2 * f] = victim;
        }
        ++done;
        __syncthreads();
    }
    if (tid == 0) {
        list[0] = done;
        tab.stats[(size_t)layer * kStatsCols + kPrefetched] += done;
    }
}

// A small fixed grid (kFetchBlocks) walks all (entry, 16-byte piece) pairs, each thread keeping
// kFetchUnroll loads in flight: enough outstanding PCIe reads to fill the link (~0.5 MiB) while
// occupying few SM slots, so a copy on a side stream leaves the compute kernels room.
constexpr int kFetchBlocks = 32;
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

}  // namespace

// ---- entry points (declared in offload_api.h, wrapped by bindings_cuda.cpp) ----------------------
namespace cuda {
namespace {
void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
}  // namespace

void offload_step_begin(int32_t* step, uintptr_t stream) {
    step_begin_kernel<<<1, 1, 0, as_stream(stream)>>>(step);
    check(cudaGetLastError(), "offload_step_begin");
}

void offload_plan(const CacheTables& tab, const Exchange& ex, int layer, const int32_t* ids,
                  const float* w, const float* x, const int32_t* step, const float* fetch_fraction,
                  int32_t* fetch_list, const int32_t* prefetched, uintptr_t stream) {
    if (ex.n_tok < 1 || ex.n_tok * ex.top_k > kMaxSel || ex.n_tok > ex.max_tok)
        throw std::invalid_argument("offload_plan: n_tok * top_k must be in [1, 64] and n_tok <= max_tok");
    plan_kernel<<<1, kPlanThreads, 0, as_stream(stream)>>>(tab, ex, layer, ids, w, x, step,
                                                           fetch_fraction, fetch_list, prefetched);
    check(cudaGetLastError(), "offload_plan");
}

void offload_prefetch(const CacheTables& tab, int layer, const int32_t* guess, int n_guess,
                      int reserve, const int32_t* step, int32_t* list, uintptr_t stream) {
    if (n_guess < 0 || n_guess > kMaxSel || reserve < 0)
        throw std::invalid_argument("offload_prefetch: 0..64 guessed experts, reserve >= 0");
    prefetch_kernel<<<1, kPlanThreads, 0, as_stream(stream)>>>(tab, layer, guess, n_guess, reserve,
                                                               step, list);
    check(cudaGetLastError(), "offload_prefetch");
}

void offload_fetch(const int32_t* fetch_list, const void* host_bank, void* pool,
                   int64_t expert_bytes, int64_t slot_bytes, int max_fetch, uintptr_t stream) {
    if (expert_bytes % 16 || slot_bytes % 16 || expert_bytes > slot_bytes || max_fetch < 1 ||
        max_fetch > kMaxSel)
        throw std::invalid_argument("offload_fetch: sizes must be multiples of 16, expert <= slot, "
                                    "1 <= max_fetch <= 64");
    fetch_kernel<<<kFetchBlocks, 256, 0, as_stream(stream)>>>(
        fetch_list, (const uint4*)host_bank, (uint4*)pool, expert_bytes, slot_bytes);
    check(cudaGetLastError(), "offload_fetch");
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
