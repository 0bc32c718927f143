// matmul: y[T, O] = x[T, H] @ W[O, H]^T straight from the blocks, all cores split the rows.
#include "cpu.h"

namespace ft::cpu {

void matmul(int type_id, const uint8_t* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
            const float* x, int64_t n_tok, float* y) {
    const IsaKernels& isa = kernels();
    const TypeKernels& k = type_kernels(isa, type_id);
    const int64_t nkb = row_kblocks(k, n_in, "matmul");
    if (w_row_stride < nkb * k.kb_bytes)
        throw std::invalid_argument("matmul: weight row stride is shorter than a row");
    if (n_tok <= 0 || n_out <= 0) return;
    const Grids& g = grids();
    ActBuf buf;
    const Act a = prepare_act(isa, x, n_in, n_tok, n_in, buf);
    // Enough rows per chunk to amortize the pool's hand-off, few enough that every core gets
    // several chunks (balance) even for one 512-row expert matrix.
    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, n_out / (8 * num_threads())));
    // Prefill: a tile of tokens stays in L2 while a chunk of rows passes over it.
    constexpr int64_t kTokenTile = 64;
    parallel_for(n_out, grain, [&](int64_t o0, int64_t o1) {
        if (k.gemm) {
            for (int64_t t0 = 0; t0 < n_tok; t0 += kTokenTile)
                k.gemm(w + o0 * w_row_stride, w_row_stride, o1 - o0, nkb, a.at(t0),
                       std::min(kTokenTile, n_tok - t0), y + t0 * n_out + o0, n_out, g);
            return;
        }
        for (int64_t t0 = 0; t0 < n_tok; t0 += kTokenTile) {
            const Act at = a.at(t0);
            const int nt = int(std::min(kTokenTile, n_tok - t0));
            // rows in pairs from the two halves of the chunk: two sequential streams (adjacent rows
            // interleave their blocks, which the hardware prefetch follows worse than one row)
            float* yt = y + t0 * n_out;
            const int64_t h = (o1 - o0) / 2;
            for (int64_t o = o0; o < o0 + h; ++o)
                dot_pair(k, w + o * w_row_stride, w + (o + h) * w_row_stride, nkb, at, nt, yt + o, yt + o + h, n_out, g);
            if ((o1 - o0) % 2) k.dot_row(w + (o1 - 1) * w_row_stride, nkb, at, nt, yt + o1 - 1, n_out, g);
        }
    });
}

}  // namespace ft::cpu
