// Shared by every kernel file of native._cuda: error handling, device facts, the IQ tables on the
// device, and small bit helpers (host fallbacks so the int8 unit decoders can be checked on a CPU).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/api.h"
#include "quants.h"

namespace ft::cuda {

[[noreturn]] void throw_cuda(cudaError_t err, const char* what);

#define FT_CUDA_CHECK(expr)                                                                        \
    do {                                                                                           \
        const cudaError_t ft_err_ = (expr);                                                        \
        if (ft_err_ != cudaSuccess) ::ft::cuda::throw_cuda(ft_err_, #expr);                        \
    } while (0)

// After a launch: a bad configuration is reported at once; nothing synchronises.
inline void check_launch(const char* what) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda(err, what);
}

inline cudaStream_t to_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Seams for a host emulation of the kernels (a g++ build with its own shim, used to check kernel
// logic where no GPU is at hand; CMake never defines FT_CUDA_EMULATE). Dynamic shared memory and
// launches are written through these two macros; everything else is plain CUDA.
#if !defined(FT_CUDA_EMULATE)
#define FT_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#define FT_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

inline void require(bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
}

struct DeviceInfo {
    int sms = 0;         // multiprocessors
    int smem_optin = 0;  // max dynamic shared memory per block after opting in (bytes)
};
const DeviceInfo& device_info();  // of the current device, read once per device

// The IQ tables on the current device (uploaded on first use there). Throws if they were never
// set and `needed` (quants.h UsesGrids<T>); otherwise returns null pointers for unset tables.
const Grids& device_grids(bool needed);

// Largest power of two <= v (v >= 1) and smallest >= v.
inline int floor_pow2(int v) { int p = 1; while (p * 2 <= v) p *= 2; return p; }
inline int ceil_pow2(int v) { int p = 1; while (p < v) p *= 2; return p; }
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sum (max) of v over the warp, the same value (added in the same order) in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- bit helpers (device intrinsics, exact host fallbacks) -----------------------------------------

// (hi:lo) >> (sh & 31), low 32 bits.
FT_HD uint32_t funnel_r(uint32_t lo, uint32_t hi, uint32_t sh) {
#if defined(__CUDA_ARCH__)
    return __funnelshift_r(lo, hi, sh);
#else
    sh &= 31;
    return sh ? (lo >> sh) | (hi << (32 - sh)) : lo;
#endif
}

// Byte permute: result byte i = byte (sel >> 4i) & 7 of the 8 bytes {hi:lo} (sel nibbles < 8).
FT_HD uint32_t prmt(uint32_t lo, uint32_t hi, uint32_t sel) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(lo, hi, sel);
#else
    const uint64_t v = (uint64_t(hi) << 32) | lo;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
#endif
}

// c + sum of the 4 signed byte products of a and b.
FT_HD int dp4a(uint32_t a, uint32_t b, int c) {
#if defined(__CUDA_ARCH__)
    return __dp4a(int(a), int(b), c);
#else
    for (int i = 0; i < 4; ++i) c += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
    return c;
#endif
}

FT_HD float half_bits_to_f32(uint32_t h16) {  // exact (hardware convert on the device)
#if defined(__CUDA_ARCH__)
    float f;
    asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(h16));
    return f;
#else
    return fp16_to_f32(uint16_t(h16));
#endif
}

}  // namespace ft::cuda
