// The memory both engines of the offload runtime share, per MoE layer, for one decode step.
// Torch-free; included by the CUDA kernels (native/csrc/cuda/offload.cu) and the CPU worker
// (native/csrc/cpu/offload_worker.cpp). All arrays are allocated by Python (torch tensors) and
// passed as raw addresses; host arrays live in page-locked memory that the GPU reads and writes
// directly (UVA: the device address equals the host address).
//
// Protocol for layer L of step s (s > 0 increases by one every step):
//   GPU plan kernel  : decides hits / fetches / CPU misses, writes cpu_ids/cpu_w (and x_host
//                      when the CPU has work), cpu_pending[L], fences, then sets gpu_flag[L] = s
//   CPU worker       : waits for gpu_flag[L] >= s, computes its experts into y_host, fences,
//                      sets cpu_flag[L] = s (also when it had nothing to do)
//   GPU wait kernel  : if cpu_pending[L] > 0, waits for cpu_flag[L] >= s (bounded) and adds
//                      y_host into the layer output; else returns at once (no PCIe round trip)
#pragma once
#include <cstdint>

namespace ft {

// Device-side residency tables of the expert cache, one row per MoE layer.
struct CacheTables {
    int32_t* slot_of_expert;  // [L, E]  slot index or -1
    int32_t* expert_of_slot;  // [L, S]  expert id or -1 (free)
    int32_t* slot_last_use;   // [L, S]  step of last use (recency)
    int32_t* slot_pinned;     // [L, S]  1: never evicted (warm-start hot set)
    int32_t* expert_freq;     // [L, E]  selections seen (frequency, for ties and fetch choice)
    int32_t* n_slots;         // [L]     usable slots (victims are searched below it; elastic)
    int32_t* stats;           // [L, kStatsCols] counters, see below
    int32_t* cpu_pending;     // [L]     experts handed to the CPU this step (0: nothing to wait for)
    int32_t* expert_score;    // [L, E]  choices lately, each decayed by age (fixed point, below)
    int32_t* expert_seen;     // [L, E]  step of the score's last update
    const int32_t* score_decay;  // [kScoreSteps] decay^age in fixed point (kScoreOne = 1.0)
    int n_experts;            // E
    int max_slots;            // S (row stride of the slot arrays)
};

// Selections a decode step may hand the plan kernel for one layer (T * K): the length of every
// fetch and prefetch list and of pair_slots' rows.
constexpr int kMaxSelections = 64;

// Per-layer counters (CacheTables::stats). kPrefetched: experts copied in ahead of their layer on
// a guess (offload_prefetch); kPrefetchHits: selections served by such a copy in the same step.
enum StatsCol { kHits = 0, kFetched = 1, kCpu = 2, kPrefetchHits = 3, kPrefetched = 4, kStatsCols = 5 };
constexpr const char* kStatsNames[kStatsCols] = {"hits", "fetched", "cpu", "prefetch_hits",
                                                 "prefetched"};

// The emulated host-to-GPU link (`--link-gbps`): int64 words in device memory. Each copy of the
// offload path (decode fetches, prefetches, prefill staging) marks its start on its stream
// (offload_link_mark) and is followed by offload_link_hold, which books its bytes on one shared
// clock (the link is free again at kLinkFreeAt, in globaltimer ns) and holds the stream until
// the booked slot ends: max(mark, free) + bytes * ns_per_byte. So copies take as long as the
// slower link would make them, whatever the real one does, and queue behind each other.
enum LinkWord {
    kLinkFreeAt = 0,     // ns at which the emulated link is next free
    kLinkMark = 1,       // kLinkMarks words: the start of the copy in flight on each copying stream
    kLinkMarks = 3,
    kLinkNsPerByte = 4,  // the rate, as a double's bits (read every hold: no re-capture to change)
    kLinkBytes = 5,      // bytes booked so far
    kLinkWords = 8,
};

// ---- the eviction score: its one definition (offload.cu; mirrored in numpy by
// native/offload_native.py's decayed_scores, which tests hold to it bit for bit) -------------------
// An expert's score counts its choices lately, each weighing decay^age (age in decode steps), in
// fixed point (kScoreOne per choice). `decay` is a table of kScoreSteps entries, decay^age in
// fixed point, built by the runtime from its policy; an age of kScoreSteps or more counts as 0.
// Victims go smallest key first: free slots, then the expert of smallest score, then the least
// recently used slot.
constexpr int kScoreOne = 1 << 16;
constexpr int kScoreSteps = 1024;

#if defined(__CUDACC__)
#define FT_OFFLOAD_HD __host__ __device__ __forceinline__
#else
#define FT_OFFLOAD_HD inline
#endif

// Expert score `score`, last updated at step `seen`, as of `step`.
FT_OFFLOAD_HD uint32_t decayed_score(int32_t score, int32_t seen, int32_t step, const int32_t* decay) {
    const int32_t age = step - seen;
    if (age >= kScoreSteps) return 0;
    return (uint32_t)(((uint64_t)(uint32_t)score * (uint32_t)decay[age < 0 ? 0 : age]) >> 16);
}

// Eviction key of an occupied, evictable slot: its expert's decayed score, then its last use.
FT_OFFLOAD_HD long long victim_key(uint32_t score, int32_t last_use) {
    return ((long long)score << 32) | (uint32_t)last_use;
}

// Host-side exchange area (page-locked), one row per layer.
struct Exchange {
    int32_t* gpu_flag;  // [L]           written by the GPU
    int32_t* cpu_flag;  // [L]           written by the CPU
    int32_t* cpu_ids;   // [L, max_tok, K]  expert for the CPU, or -1
    float* cpu_w;       // [L, max_tok, K]  its routing weight
    float* x_host;      // [L, max_tok, H]  the layer's MoE input, copied by the GPU
    float* y_host;      // [L, max_tok, H]  the CPU experts' weighted sum
    int n_tok;          // T this step (<= max_tok; fixed for a captured step)
    int max_tok;        // row stride of the [L, T, ...] arrays
    int top_k;          // K
    int hidden;         // H
};

}  // namespace ft
