// The AVX2 IQ3_S kernels in a second form: each sub's 8 grid entries come from one vpgatherdd
// instead of 8 scalar loads (units_avx2.h, FT_IQ3S_GATHER). Same integers, same bits. Which form
// the avx2 table uses is chosen at load by the CPU's vendor (dispatch.cpp): the gather measured
// faster on Intel cores (docs/BENCHMARKS.md, "CPU engine"), the loads on Zen 3.
//
// Like kernels_avx512.cpp, every shared header is compiled here in a namespace of its own, so
// this file's copy of an inline function (Unit<IQ3_S>::grid above all) is never the one the
// linker keeps for the other files; the entry is handed over through a C name.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define ft ft_avx2_gather
#define FT_IQ3S_GATHER
#include "q8_kernels.h"

extern "C" void ft_cpu_fill_avx2_iq3s_gather(void* type_kernels) {
    using namespace ft::cpu;
    using ft::QType;
    auto& t = *static_cast<TypeKernels*>(type_kernels);  // the other files' layout: identical
    t.dot_row = avx2::dot_row_q8<avx2::DotAvx2, QType::IQ3_S, 2>;
    t.gemm = avx2::gemm_q8<avx2::DotAvx2, QType::IQ3_S, 2>;
}
#undef ft
