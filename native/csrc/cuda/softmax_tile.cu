// The online softmax's update for one tile of a prompt chunk's attention over its cached prefix
// (moe_offload/models/attention.py, attention_tiled). A tile's scores are the biggest tensor of
// that loop (a 2,048-token chunk of 16 heads over 1,024 rows: 128 MiB), so the passes over
// them, not the two products, set its time at long contexts. The torch ops make six passes (max;
// subtract and exp, a read and a write each; sum) and more where the causal mask cuts the tile;
// this kernel makes three: one read for the max, one read and one write for the rest.
#include <type_traits>

#include "cuda/api.h"
#include "cuda/common.cuh"

namespace ft::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // a warp a row

// Row r: columns c < seen (its position's causal limit, or n) count; the rest are -inf. A lane
// takes 4 columns at a time (a warp reads 512 contiguous bytes a load) where n and ld allow.
template <bool VEC>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
softmax_tile_kernel(float* s, int64_t rows, int n, int64_t ld, float* m, float* l, float* corr,
                    const int64_t* pos, int64_t T, int64_t j0) {
    constexpr int V = VEC ? 4 : 1;
    using Vec = std::conditional_t<VEC, float4, float>;
    const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    Vec* row = reinterpret_cast<Vec*>(s + r * ld);
    int64_t limit = n;
    if (pos) limit = pos[r % T] - j0 + 1;
    const int seen = int(limit < 0 ? 0 : limit > n ? n : limit);
    float mx = -INFINITY;
#pragma unroll 4
    for (int c = lane * V; c < seen; c += 32 * V) {
        const Vec x = row[c / V];
        const float* e = reinterpret_cast<const float*>(&x);
#pragma unroll
        for (int i = 0; i < V; ++i) mx = fmaxf(mx, c + i < seen ? e[i] : -INFINITY);
    }
    const float m_old = m[r], m_new = fmaxf(m_old, warp_max(mx));
    float sum = 0.f;
#pragma unroll 4
    for (int c = lane * V; c < n; c += 32 * V) {
        Vec x = row[c / V];
        float* e = reinterpret_cast<float*>(&x);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            e[i] = c + i < seen ? expf(e[i] - m_new) : 0.f;
            sum += e[i];
        }
        row[c / V] = x;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
        const float cr = expf(m_old - m_new);  // 0 at the first tile (m_old -inf)
        m[r] = m_new;
        l[r] = l[r] * cr + sum;
        corr[r] = cr;
    }
}

}  // namespace

void softmax_tile(float* s, int64_t rows, int64_t n, int64_t ld, float* m, float* l, float* corr,
                  const int64_t* pos, int64_t T, int64_t j0, uintptr_t stream) {
    if (rows <= 0 || n <= 0) return;
    require(n <= INT32_MAX && ld >= n && (pos == nullptr || T > 0),
            "softmax_tile: a row holds at most 2^31 - 1 columns, ld >= n, T > 0 with positions");
    const dim3 grid(unsigned(cdiv(rows, kRowsPerBlock))), block(32 * kRowsPerBlock);
    if (n % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(s) % 16 == 0)
        FT_LAUNCH(softmax_tile_kernel<true>, grid, block, 0, to_stream(stream), s, rows, int(n), ld, m, l,
                  corr, pos, T, j0);
    else
        FT_LAUNCH(softmax_tile_kernel<false>, grid, block, 0, to_stream(stream), s, rows, int(n), ld, m, l,
                  corr, pos, T, j0);
    check_launch("softmax_tile");
}

}  // namespace ft::cuda
