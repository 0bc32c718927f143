// moe_ffn: y[T, H] = sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,k] (< 0: skip).
//
// Phase 1 (all cores over (expert, block of F rows)): gate and up rows of each used expert against
// the tokens routed to it -> h = silu(g) * u, [slots, F]. Phase 2 (all cores over blocks of H
// rows): every used expert's down rows against its h, weighted and summed into y in a fixed
// expert order (so the result does not depend on the thread count). Even one token keeps every
// core busy: K experts x F rows, then H rows.
#include <cmath>
#include <memory>

#include "cpu.h"

namespace ft::cpu {
namespace {

constexpr int64_t kRowsPerTask = 32;
// Bounds the gathered activations of a long prefill (~60 MB at the 35B's shapes). A 512-token
// prompt chunk stays whole: 16 tokens an expert on average, each weight row decoded once for them.
constexpr int64_t kTokenChunk = 512;

struct Group {
    int64_t e, off, n;  // expert, first slot, slot count
};

void moe_chunk(const float* x, int64_t T, int64_t H, int64_t F, int64_t E, const int32_t* ids,
               const float* weights, int64_t K, const Bank& gate, const Bank& up,
               const Bank& down, float* y) {
    const IsaKernels& isa = kernels();
    const TypeKernels &kg = type_kernels(isa, gate.type_id), &ku = type_kernels(isa, up.type_id),
                      &kd = type_kernels(isa, down.type_id);
    const int64_t nkb_g = row_kblocks(kg, H, "moe_ffn gate"), nkb_u = row_kblocks(ku, H, "moe_ffn up");
    const int64_t nkb_d = row_kblocks(kd, F, "moe_ffn down");
    const int64_t rb_g = nkb_g * kg.kb_bytes, rb_u = nkb_u * ku.kb_bytes, rb_d = nkb_d * kd.kb_bytes;
    const Grids& g = grids();

    // Slots grouped by expert (counting sort keeps token order inside an expert).
    std::vector<int64_t> count(E + 1, 0);
    for (int64_t i = 0; i < T * K; ++i)
        if (ids[i] >= 0) ++count[ids[i] + 1];  // ids < E: checked by moe_ffn
    std::vector<Group> groups;
    for (int64_t e = 0; e < E; ++e) {
        if (count[e + 1]) groups.push_back({e, count[e], count[e + 1]});
        count[e + 1] += count[e];
    }
    const int64_t n_slots = count[E];
    if (n_slots == 0) {
        std::fill(y, y + T * H, 0.f);
        return;
    }
    std::vector<int64_t> tok(n_slots);
    std::vector<float> wt(n_slots);
    for (int64_t i = 0; i < T * K; ++i) {
        if (ids[i] < 0) continue;
        const int64_t s = count[ids[i]]++;
        tok[s] = i / K;
        wt[s] = weights[i];
    }
    // The gathered rows and the hidden activations: tens of MB for a prompt chunk, left
    // uninitialized and filled over the pool (on one thread, zeroing and copying them took as
    // long as a sixth of the experts' work on 16 cores).
    const std::unique_ptr<float[]> xg(new float[n_slots * H]), hg(new float[n_slots * F]),
        hu(new float[n_slots * F]);
    auto gather = [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s) std::copy(x + tok[s] * H, x + (tok[s] + 1) * H, xg.get() + s * H);
    };
    if (n_slots * H < (1 << 16)) gather(0, n_slots);  // a decode token: cheaper than the pool
    else parallel_for(n_slots, 16, gather);

    // Phase 1: gate/up, then h = silu(g) * u in place of g.
    ActBuf xbuf;
    const Act xa = prepare_act(isa, xg.get(), H, n_slots, H, xbuf, ActNeeds().add(kg).add(ku));
    std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, first row)
    for (int64_t i = 0; i < int64_t(groups.size()); ++i)
        for (int64_t f = 0; f < F; f += kRowsPerTask) tasks.push_back({i, f});
    parallel_for(int64_t(tasks.size()), 1, [&](int64_t a, int64_t b) {
        for (int64_t task = a; task < b; ++task) {
            const Group& gr = groups[tasks[task].first];
            const int64_t f0 = tasks[task].second, f1 = std::min(F, f0 + kRowsPerTask);
            const uint8_t* wg = gate.base + gr.e * gate.expert_stride;
            const uint8_t* wu = up.base + gr.e * up.expert_stride;
            const Act xe = xa.at(gr.off);
            float* ge = hg.get() + gr.off * F;
            float* ue = hu.get() + gr.off * F;
            if (kg.gemm && ku.gemm) {  // each row decoded once for all the expert's tokens
                kg.gemm(wg + f0 * rb_g, rb_g, f1 - f0, nkb_g, xe, gr.n, ge + f0, F, g);
                ku.gemm(wu + f0 * rb_u, rb_u, f1 - f0, nkb_u, xe, gr.n, ue + f0, F, g);
            } else for (int64_t f = f0; f < f1; ++f) {
                if (&kg == &ku) {  // one type: the gate and up rows share the activation loads
                    dot_pair(kg, wg + f * rb_g, wu + f * rb_u, nkb_g, xe, int(gr.n), ge + f, ue + f, F, g);
                } else {
                    kg.dot_row(wg + f * rb_g, nkb_g, xe, int(gr.n), ge + f, F, g);
                    ku.dot_row(wu + f * rb_u, nkb_u, xe, int(gr.n), ue + f, F, g);
                }
            }
            for (int64_t t = 0; t < gr.n; ++t)
                for (int64_t f = f0; f < f1; ++f) {
                    const float v = ge[t * F + f];
                    ge[t * F + f] = v / (1.f + std::exp(-v)) * ue[t * F + f];
                }
        }
    });

    // Phase 2: down rows, weighted sum over experts in ascending expert order.
    ActBuf hbuf;
    const Act ha = prepare_act(isa, hg.get(), F, n_slots, F, hbuf, ActNeeds().add(kd));
    parallel_for(H, kRowsPerTask, [&](int64_t r0, int64_t r1) {
        thread_local std::vector<float> out;
        for (int64_t t = 0; t < T; ++t) std::fill(y + t * H + r0, y + t * H + r1, 0.f);
        for (const Group& gr : groups) {
            if (int64_t(out.size()) < 2 * gr.n) out.resize(2 * gr.n);
            const uint8_t* wd = down.base + gr.e * down.expert_stride;
            const Act he = ha.at(gr.off);
            auto add = [&](int64_t r, const float* o) {
                for (int64_t s = 0; s < gr.n; ++s) y[tok[gr.off + s] * H + r] += wt[gr.off + s] * o[s];
            };
            if (kd.gemm) {  // out[s * nr + r - r0]: every row of the block for every slot
                const int64_t nr = r1 - r0;
                if (int64_t(out.size()) < nr * gr.n) out.resize(nr * gr.n);
                kd.gemm(wd + r0 * rb_d, rb_d, nr, nkb_d, he, gr.n, out.data(), nr, g);
                for (int64_t s = 0; s < gr.n; ++s) {
                    float* yt = y + tok[gr.off + s] * H + r0;
                    const float ws = wt[gr.off + s];
                    const float* o = out.data() + s * nr;
                    for (int64_t r = 0; r < nr; ++r) yt[r] += ws * o[r];
                }
                continue;
            }
            // rows r and r + h in pairs, as in matmul (two sequential streams); r1 - r0 is even:
            // H, a whole number of kernel blocks of the gate rows, is a multiple of 32
            const int64_t h = (r1 - r0) / 2;
            for (int64_t r = r0; r < r0 + h; ++r) {
                dot_pair(kd, wd + r * rb_d, wd + (r + h) * rb_d, nkb_d, he, int(gr.n), out.data(), out.data() + gr.n, 1, g);
                add(r, out.data());
                add(r + h, out.data() + gr.n);
            }
        }
    });
}

}  // namespace

void moe_ffn(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             const int32_t* ids, const float* weights, int64_t top_k, const Bank& gate,
             const Bank& up, const Bank& down, float* y) {
    if (hidden <= 0 || ff <= 0 || n_experts <= 0 || top_k <= 0)
        throw std::invalid_argument("moe_ffn: hidden, ff, n_experts and top_k must be positive");
    const IsaKernels& isa = kernels();  // every check before any output is written
    for (const Bank* b : {&gate, &up, &down}) type_kernels(isa, b->type_id);
    row_kblocks(type_kernels(isa, gate.type_id), hidden, "moe_ffn gate");
    row_kblocks(type_kernels(isa, up.type_id), hidden, "moe_ffn up");
    row_kblocks(type_kernels(isa, down.type_id), ff, "moe_ffn down");
    for (int64_t i = 0; i < n_tok * top_k; ++i)
        if (ids[i] >= n_experts)
            throw std::invalid_argument("moe_ffn: expert id " + std::to_string(ids[i]) +
                                        " is out of range for " + std::to_string(n_experts) + " experts");
    for (int64_t t0 = 0; t0 < n_tok; t0 += kTokenChunk) {
        const int64_t n = std::min(kTokenChunk, n_tok - t0);
        moe_chunk(x + t0 * hidden, n, hidden, ff, n_experts, ids + t0 * top_k, weights + t0 * top_k,
                  top_k, gate, up, down, y + t0 * hidden);
    }
}

}  // namespace ft::cpu
