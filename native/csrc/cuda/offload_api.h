// Host entry points of the offload decode-step kernels (csrc/cuda/offload.cu), free of CUDA types
// so bindings_cuda.cpp compiles with the host compiler. Conventions of api.h: device (or mapped
// host) pointers owned by the caller, `stream` a cudaStream_t as an integer, enqueue-only and
// capturable; bad arguments throw std::invalid_argument, launch failures std::runtime_error.
// The shared-memory protocol and table layouts: csrc/offload_exchange.h.
#pragma once
#include <cstddef>
#include <cstdint>

#include "offload_exchange.h"

namespace ft::cuda {

// *step += 1 on the device: the first node of every decode step.
void offload_step_begin(int32_t* step, uintptr_t stream);
// Layer `layer`: hits / fetches / CPU misses for ids [T, K] (int32), weights [T, K], x [T, H];
// fetch_fraction (device, float[2]): the link's share of the layer's expert copies and the fewest
// misses to fetch; `guessed` (device int32, may be null): how many experts this step's guesses
// copied into the layer, which count in the link's share (of nm misses, q*(nm + g) - g are
// fetched); updates the residency tables, writes the fetch list ([1 + 2*64] int32) and the CPU
// hand-off.
// A hit whose slot is already used this step was given it by this step's offload_prefetch (the
// plan runs once per layer and step), so its copy may be in flight: counted in kPrefetchHits.
// `pair_slots` (may be null, [2][64] int32): per selection, its slot if its bytes were resident
// before this step (row 0), or if it is fetched by this plan or was guessed (row 1: copies may be
// in flight), else -1; the rows feed moe_ffn_pool as slot ids, so the resident experts compute
// while the copies cross PCIe.
void offload_plan(const CacheTables& tab, const Exchange& ex, int layer, const int32_t* ids,
                  const float* w, const float* x, const int32_t* step, const float* fetch_fraction,
                  const int32_t* guessed, int32_t* fetch_list, int32_t* pair_slots, uintptr_t stream);
// Before layer `layer` runs: slots for the guessed experts guess[0..n_guess) (int32, <= 64) that
// are not resident, marked used this step, leaving `reserve` evictable slots (the layer's T*K
// selections) for its own misses; writes the list ([1 + 2*64] int32: count, (expert, slot)...)
// for offload_fetch and for the layer's plan. Adds to stats kPrefetched.
void offload_prefetch(const CacheTables& tab, int layer, const int32_t* guess, int n_guess,
                      int reserve, const int32_t* step, int32_t* list, uintptr_t stream);
// Copies each listed expert (expert_bytes) from the host bank [E, expert_bytes] to its slot
// of the pool [S, slot_bytes] (at most max_fetch entries); a small grid of `blocks` blocks, so a
// copy on a side stream leaves SMs to the compute kernels.
void offload_fetch(const int32_t* fetch_list, const void* host_bank, void* pool,
                   int64_t expert_bytes, int64_t slot_bytes, int max_fetch, int blocks,
                   uintptr_t stream);
// Waits (at most timeout_ns; then *error_flag = layer + 1 and the CPU part is dropped) for the
// CPU worker's layer result and adds it: y [T, H] += y_host[layer]. Nothing when the layer's plan
// handed the CPU no expert (cpu_pending[layer] == 0, CacheTables::cpu_pending).
void offload_wait_add(const Exchange& ex, int layer, const int32_t* step,
                      const int32_t* cpu_pending, float* y, int64_t timeout_ns,
                      int32_t* error_flag, uintptr_t stream);
// The emulated link (LinkWord, offload_exchange.h; `clock` = int64[kLinkWords] on the device):
// offload_link_mark stamps the start of the next copy on this stream in mark slot `which`;
// offload_link_hold, queued after the copy, books count[0] * bytes_each bytes (bytes_each when
// count is null) from that mark on the shared clock and holds the stream until the booking ends.
void offload_link_mark(uint64_t* clock, int which, uintptr_t stream);
void offload_link_hold(uint64_t* clock, int which, const int32_t* count, int64_t bytes_each,
                       uintptr_t stream);
// Page-lock (and map) host memory for zero-copy GPU reads; requires device address == host
// address (UVA), else throws. Synchronous.
void pin_host(void* p, size_t nbytes);
void unpin_host(void* p);

// Elastic device memory (csrc/cuda/vmm.cu, CUDA virtual memory management): an address range
// reserved once, physical memory mapped into it and unmapped at run time, so a pool grows and
// shrinks without moving. Sizes and offsets are multiples of vmm_granularity(); memory is on the
// current device, readable and writable by it. Synchronous; errors throw std::runtime_error.
bool vmm_supported();
size_t vmm_granularity();
uintptr_t vmm_reserve(size_t bytes);             // the range; nothing mapped
void vmm_free(uintptr_t va, size_t bytes);       // after every chunk is unmapped
uint64_t vmm_map(uintptr_t va, size_t bytes);    // new memory mapped at va -> its handle
void vmm_unmap(uintptr_t va, size_t bytes, uint64_t handle);  // unmapped and freed

}  // namespace ft::cuda
