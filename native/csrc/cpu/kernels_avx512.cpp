// AVX-512 VNNI row kernels: the q8 kernels of q8_kernels.h with one vpdpbusd (AVX512-VNNI on
// 256-bit vectors, AVX512-VL) per 32 weights and token instead of maddubs + madd (one 512-bit
// vpdpbusd per 64 in the block form's decode streams), and 4-row register blocks (32 vector
// registers); the int16 kernels of q16_kernels.h with one 512-bit madd per 32 weights. Float types, dequantize and the activation rounding
// stay the AVX2 table's. Chosen at run time when CPUID reports AVX512 F/BW/DQ/VL/VNNI besides AVX2.
//
// Built with AVX-512 flags (CMakeLists.txt), so every header is compiled here in a namespace of
// its own (`ft` renamed): otherwise an inline function of a shared header (Act::at, ld_u32, ...)
// built here could be the copy the linker keeps for the other files, and run on a CPU without
// AVX-512. The table is handed over through an extern "C" function taking the other files' type.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define ft ft_avx512
#define FT_IQ3S_GATHER
#include "q16_kernels.h"

extern "C" void ft_cpu_fill_avx512(void* isa_kernels) {
    // the same declarations compiled under another namespace name: the layouts are identical
    auto& k = *static_cast<ft::cpu::IsaKernels*>(isa_kernels);
    k.name = "avx512";
    ft::cpu::avx2::fill_q8<ft::cpu::avx2::DotVnni, 4>(k);
    ft::cpu::avx2::fill_q16<4>(k);
}
#undef ft
