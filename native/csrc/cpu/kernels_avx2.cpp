// AVX2 + FMA row kernels (placeholder: overrides land next).
#include <immintrin.h>

#include "cpu.h"

namespace ft::cpu {
void fill_avx2(IsaKernels& k) { (void)k; }
}  // namespace ft::cpu
