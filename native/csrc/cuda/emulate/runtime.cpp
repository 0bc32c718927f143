// Emulator runtime: thread/barrier machinery for shim.h and the few CUDA runtime calls the
// kernels' host code makes (2 "SMs", 227 KiB of shared memory per block; EMU_SMS overrides).
#include "shim.h"
#include <thread>
#include <mutex>
#include <condition_variable>
#include <chrono>
#include <cstdio>
#include <cstdlib>
thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;
namespace ft_emu {
struct Barrier {
  std::mutex m; std::condition_variable cv; int n = 0, count = 0; uint64_t gen = 0;
  void wait() {
    std::unique_lock<std::mutex> l(m); uint64_t g = gen;
    if (++count == n) { count = 0; ++gen; cv.notify_all(); return; }
    if (!cv.wait_for(l, std::chrono::seconds(20), [&] { return gen != g; })) {
      fprintf(stderr, "EMU DEADLOCK: barrier of %d stuck at %d (thread %u block %u,%u)\n", n, count, threadIdx.x, blockIdx.x, blockIdx.y);
      std::abort();
    }
  }
};
struct Block { std::vector<Barrier> warps; Barrier all; std::vector<uint64_t> slots; std::vector<uint8_t> smem; };
static Block* cur = nullptr;
struct Copy { void* dst; uintptr_t src; int n; };
thread_local std::vector<std::vector<Copy>> groups; thread_local std::vector<Copy> open_group;
void warp_sync() { cur->warps[threadIdx.x / 32].wait(); }
void block_sync() { cur->all.wait(); }
uint64_t* warp_slots() { return cur->slots.data() + (threadIdx.x / 32) * 32; }
uint8_t* dyn_smem() { return cur->smem.data(); }
void cp_async(void* dst, uintptr_t src, int n) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) || (src & 15)) { fprintf(stderr, "EMU: misaligned cp.async\n"); std::abort(); }
  open_group.push_back({dst, src, n});
}
static void exec(const std::vector<Copy>& g) { for (auto& c : g) { memcpy(c.dst, (const void*)c.src, c.n); memset((uint8_t*)c.dst + c.n, 0, 16 - c.n); } }
void commit() { groups.push_back(open_group); open_group.clear(); }
void wait(int n) { while ((int)groups.size() > n) { exec(groups.front()); groups.erase(groups.begin()); } }
void run(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  if (block.x % 32) { fprintf(stderr, "EMU: block not a multiple of 32\n"); std::abort(); }
  for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
    Block b; int nw = block.x / 32; b.warps = std::vector<Barrier>(nw); for (auto& w : b.warps) w.n = 32;
    b.all.n = block.x; b.slots.assign(block.x, 0);
    b.smem.resize(smem + 64);
    // poison shared memory: reads of never-written bytes show up as garbage
    for (size_t i = 0; i < b.smem.size(); ++i) b.smem[i] = uint8_t(0xA5 ^ i);
    // 16-align the dynamic smem start
    cur = &b;
    std::vector<std::thread> th;
    for (unsigned t = 0; t < block.x; ++t) th.emplace_back([&, t] {
      threadIdx = make_uint3(t, 0, 0); blockIdx = make_uint3(bx, by, 0); blockDim = block; gridDim = grid;
      groups.clear(); open_group.clear();
      body();
      if (!open_group.empty()) { fprintf(stderr, "EMU: uncommitted cp.async at exit\n"); }
      wait(0);
    });
    for (auto& x : th) x.join();
    cur = nullptr;
  }
}
}
// ---- fake runtime ----
extern "C" {
cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  if (a == cudaDevAttrMultiProcessorCount) *v = getenv("EMU_SMS") ? atoi(getenv("EMU_SMS")) : 2;
  else if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin) *v = 232448; else *v = 0; return cudaSuccess; }
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int, size_t) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "emu"; }
const char* cudaGetErrorString(cudaError_t) { return "emu"; }
cudaError_t cudaMalloc(void** p, size_t n) { *p = aligned_alloc(256, (n + 255) / 256 * 256); return cudaSuccess; }
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) { *p = aligned_alloc(256, (n + 255) / 256 * 256); memset(*p, 0x7f, n); return cudaSuccess; }
cudaError_t cudaFreeAsync(void* p, cudaStream_t) { free(p); return cudaSuccess; }
}
// float_rows.cu launches with <<<>>> (tested on a GPU against torch): the bindings still take its
// address, so the emulated module gets a stub that says so if called.
#include <stdexcept>
namespace ft::cuda {
void float_matmul(int, const void*, int64_t, int64_t, int64_t, const float*, int64_t, float*, uintptr_t) {
  throw std::runtime_error("float_matmul is not emulated (float_rows.cu runs on a GPU only)");
}
}
