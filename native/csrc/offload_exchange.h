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

// kPrefetched: experts copied in ahead of their layer on a guess (offload_prefetch); kPrefetchHits:
// selections served by such a copy in the same step.
// Expert scores (eviction: smallest score first, then least recently used): fixed point with
// kScoreOne per choice; an age of kScoreSteps steps or more decays a score to 0. The decay table
// comes from native/offload_native.py (score_decay_table), so both sides compute the same keys.
constexpr int kScoreOne = 1 << 16;
constexpr int kScoreSteps = 1024;

enum StatsCol { kHits = 0, kFetched = 1, kCpu = 2, kPrefetchHits = 3, kPrefetched = 4, kStatsCols = 5 };

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
