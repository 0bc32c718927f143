// matmul: y[T, O] = x[T, H] @ W[O, H]^T straight from the blocks, all cores split the rows.
// matmul_multi: several weights that read the same x (a layer's input projections, the router
// and the shared expert's gate and up) in one call: x is rounded to int8 once, and one
// parallel_for splits the rows of all of them, so small weights (32-row gates) cost no hand-off
// of their own and every thread has work even when each weight alone is too small to split.
#include <algorithm>

#include "cpu.h"

namespace ft::cpu {

void matmul_multi(const MatW* ws, int n_w, int64_t n_in, const float* x, int64_t n_tok, float* y,
                  int64_t ldy) {
    const IsaKernels& isa = kernels();
    struct W {
        const TypeKernels* k;
        const uint8_t* w;
        int64_t rows, stride, nkb, col;
    };
    std::vector<W> v;
    int64_t total_rows = 0, total_bytes = 0;
    for (int j = 0; j < n_w; ++j) {  // every check before any output is written
        const TypeKernels& k = type_kernels(isa, ws[j].type_id);
        const int64_t nkb = row_kblocks(k, n_in, "matmul");
        if (ws[j].row_stride < nkb * k.kb_bytes)
            throw std::invalid_argument("matmul: weight row stride is shorter than a row");
        if (ws[j].n_out < 0) throw std::invalid_argument("matmul: negative output size");
        v.push_back({&k, ws[j].w, ws[j].n_out, ws[j].row_stride, nkb, total_rows});
        total_rows += ws[j].n_out;
        total_bytes += ws[j].n_out * nkb * k.kb_bytes;
    }
    if (ldy < total_rows) throw std::invalid_argument("matmul: output row stride below the outputs");
    if (n_tok <= 0 || total_rows == 0) return;
    const Grids& g = grids();
    ActBuf buf;
    ActNeeds needs;
    for (const W& m : v) needs.add(*m.k);
    const Act a = prepare_act(isa, x, n_in, n_tok, n_in, buf, needs);
    // Enough rows per chunk to amortize the pool's hand-off, few enough that every core gets
    // several chunks (balance) even for one 512-row expert matrix.
    const int nth = num_threads();
    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, total_rows / (8 * nth)));
    struct Task {
        int32_t j;
        int64_t o0, o1;
    };
    std::vector<Task> tasks;
    for (int j = 0; j < n_w; ++j)
        for (int64_t o = 0; o < v[j].rows; o += grain) tasks.push_back({j, o, std::min(v[j].rows, o + grain)});
    // Prefill: a tile of tokens stays in L2 while a chunk of rows passes over it.
    constexpr int64_t kTokenTile = 64;
    auto run = [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const W& m = v[tasks[i].j];
            const TypeKernels& k = *m.k;
            const int64_t o0 = tasks[i].o0, o1 = tasks[i].o1;
            const uint8_t* w = m.w;
            float* yc = y + m.col;
            if (k.gemm) {
                for (int64_t t0 = 0; t0 < n_tok; t0 += kTokenTile)
                    k.gemm(w + o0 * m.stride, m.stride, o1 - o0, m.nkb, a.at(t0),
                           std::min(kTokenTile, n_tok - t0), yc + t0 * ldy + o0, ldy, g);
                continue;
            }
            for (int64_t t0 = 0; t0 < n_tok; t0 += kTokenTile) {
                const Act at = a.at(t0);
                const int nt = int(std::min(kTokenTile, n_tok - t0));
                // rows in pairs from the two halves of the chunk: two sequential streams (adjacent
                // rows interleave their blocks, which the hardware prefetch follows worse)
                float* yt = yc + t0 * ldy;
                const int64_t h = (o1 - o0) / 2;
                for (int64_t o = o0; o < o0 + h; ++o)
                    dot_pair(k, w + o * m.stride, w + (o + h) * m.stride, m.nkb, at, nt, yt + o,
                             yt + o + h, ldy, g);
                if ((o1 - o0) % 2) k.dot_row(w + (o1 - 1) * m.stride, m.nkb, at, nt, yt + o1 - 1, ldy, g);
            }
        }
    };
    // A few KiB of weights (a 32-row gate for one token): less work than handing it to the pool.
    if (total_bytes * n_tok < (32 << 10)) return run(0, int64_t(tasks.size()));
    parallel_for(int64_t(tasks.size()), 1, run);
}

void matmul(int type_id, const uint8_t* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
            const float* x, int64_t n_tok, float* y) {
    const MatW one{type_id, w, n_out, w_row_stride};
    matmul_multi(&one, 1, n_in, x, n_tok, y, n_out);
}

}  // namespace ft::cpu
