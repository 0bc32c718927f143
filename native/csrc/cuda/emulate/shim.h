// Host emulation of the CUDA constructs ftpatch's kernels use, for checking kernel *logic* on a
// machine without a GPU (developer tool; CMake never builds it, CI never runs it; see run.sh).
// One std::thread per CUDA thread, blocks one after another, condition-variable barriers for
// __syncwarp / __syncthreads / shuffles (a warp whose lanes disagree on a barrier deadlocks, which
// the runtime reports), cp.async copies deferred until the wait that must complete them (a read
// before its wait sees stale data), shared memory poisoned at block start. It says nothing about
// speed, and nothing about what only hardware does (memory model corners, PTX semantics).
// Force-included (-include) before each kernel source, compiled with g++ -DFT_CUDA_EMULATE.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>
#include <functional>
using std::min; using std::max;

#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __restrict__
#define __restrict__

extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;

namespace ft_emu {
void warp_sync();
void block_sync();
uint64_t* warp_slots();
uint8_t* dyn_smem();
void cp_async(void* dst, uintptr_t src, int n);
void commit();
void wait(int n);
void run(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);
template <class T> T shfl_xor(T v, int o) {
  uint64_t* s = warp_slots(); int lane = threadIdx.x & 31;
  uint64_t b = 0; memcpy(&b, &v, sizeof(T)); s[lane] = b; warp_sync();
  uint64_t r = s[lane ^ o]; warp_sync(); T out; memcpy(&out, &r, sizeof(T)); return out;
}
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return ft_emu::shfl_xor(v, o); }
inline void __syncwarp(unsigned = 0xffffffffu) { ft_emu::warp_sync(); }
inline void __syncthreads() { ft_emu::block_sync(); }
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
inline float __expf(float v) { return std::exp(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }

#define FT_DYNAMIC_SMEM(name) uint8_t* name = ft_emu::dyn_smem()
#define FT_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ft_emu::run(dim3(grid), dim3(block), smem, [&]() { kernel(__VA_ARGS__); })

namespace ft::cuda {
inline void cp_async16(void* smem, uintptr_t gmem, int src_bytes) { ft_emu::cp_async(smem, gmem, src_bytes); }
inline void cp_async_commit() { ft_emu::commit(); }
template <int N> inline void cp_async_wait() { ft_emu::wait(N); }
}
