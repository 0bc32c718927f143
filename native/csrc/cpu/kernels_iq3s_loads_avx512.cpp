// The AVX-512 IQ3_S kernels in a second form: in the decode path (dot_stream_cols512) each
// column's 16 grid entries come from broadcast loads merged by blends instead of one 16-index
// vpgatherdd (units_avx2.h, Unit<IQ3_S>::grid_col2 without FT_IQ3S_GATHER). Same integers, same
// bits. dispatch.cpp picks the form as for the avx2 table: gathers on Intel, loads elsewhere
// (AMD's gathers are microcoded; FTPATCH_IQ3S_GRID overrides).
//
// As in kernels_avx512.cpp, every shared header is compiled here in a namespace of its own; the
// entry is handed over through a C name.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define ft ft_avx512_loads
#include "q8_kernels.h"

extern "C" void ft_cpu_fill_avx512_iq3s_loads(void* type_kernels) {
    using namespace ft::cpu;
    using ft::QType;
    auto& t = *static_cast<TypeKernels*>(type_kernels);  // the other files' layout: identical
    t.dot_row = avx2::dot_row_q8<avx2::DotVnni, QType::IQ3_S, 4>;
    t.gemm = avx2::gemm_q8<avx2::DotVnni, QType::IQ3_S, 4>;
}
#undef ft
