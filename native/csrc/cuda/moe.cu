// Routed experts over a device-resident slot pool, for decode (T <= 8 tokens per call).
// MoE legend: T tokens, K top-k, H hidden, F expert ff; pair p = t*K + k. A *group* is one resident
// slot and the tokens that chose it (a token mask): its weights are read, and each of its blocks
// decoded, once a call however many of the tokens chose it.
//
//   1. group    one CTA per token rounds its x into the gate/up policies' layouts (once, not once
//               per CTA of the next kernel); one more turns the routing into groups, in order of
//               first appearance: slot, token mask, and the group's rows of a compact pair order
//               (group u owns rows start[u] .. start[u] + popc(mask[u]) - 1, by token);
//               row_of[p] = -1 and skipped[p] = 1 for a pair whose expert is not resident.
//   2. gate/up  rows engine, tile = (group, projection, rows): one weight row dotted with the x of
//               every token of the mask -> gu[row][0|1][f]
//   3. act      h_row = silu(gu[row][0]) * gu[row][1] in the down policy's layout
//   4. down     rows engine, tile = (group, hidden rows): part[row][h] = W[slot] row h . h_row
//   5. sum      y[t][h] (+)= sum over k, in order, of weights[t,k] * part[row_of[t,k]][h]
//
// A pair's arithmetic does not depend on which other pairs share its group, and each token sums
// its own k in order, so a token's output is bit-identical whatever else is in the call (a decode
// step, a verify step's tokens and a batch's sequences agree). The residency lookup happens on
// the device, so the host never waits for routing. Scratch (moe_scratch_bytes) holds groups, x,
// gu, act and part; all kernels go to `stream`; nothing syncs or allocates (moe_ffn, the
// native._cpu-compatible entry, takes its scratch from cudaMallocAsync).
#include "cuda/rows.cuh"

namespace ft::cuda {
namespace {

constexpr int kMaxTok = 8, kMaxTopK = 16, kMaxPairs = kMaxTok * kMaxTopK;

// Slot of pair p, or -1 if the pair contributes nothing here.
struct Residency {
    const int32_t* ids;  // [T*K]
    const int32_t* soe;  // [E] slot_of_expert, or nullptr: slot = expert
    int E, n_slots;
    __device__ int slot(int p) const {
        const int e = __ldg(ids + p);
        if (e < 0 || e >= E) return -1;
        const int s = soe ? __ldg(soe + e) : e;
        return s >= 0 && s < n_slots ? s : -1;
    }
};

// The groups of one call, in scratch (written by group_kernel, read by the others).
struct Groups {
    int32_t* count;   // [0] groups, [1] rows (= resident pairs)
    int32_t* slot;    // [TK] per group
    int32_t* mask;    // [TK] per group: bit t = token t chose it
    int32_t* start;   // [TK] per group: its first row
    int32_t* row_of;  // [TK] per pair: its row, or -1
};

__device__ __forceinline__ int rank_in(uint32_t mask, int t) { return __popc(mask & ((1u << t) - 1u)); }

// CTAs 0..T-1: token t's x in the gate/up layouts; CTA T: the groups (at the same time).
template <bool kQ8, bool kF32>
__global__ void __launch_bounds__(kThreads)
group_kernel(Residency res, int T, int K, GlobalX x, int ng, Groups g, uint8_t* xq8, float* xf32,
             int32_t* skipped) {
    const int t = blockIdx.x;
    if (t < T) {
        auto load = [&](int, int gi, int j) { return x(t, gi, j); };
        if constexpr (kQ8)
            prep_x_q8(load, 1, ng, xq8 + size_t(t) * ng * 32,
                      reinterpret_cast<float2*>(xq8 + size_t(T) * ng * 32) + size_t(t) * ng);
        if constexpr (kF32) prep_x_f32(load, 1, ng, xf32 + size_t(t) * ng * 36);
        return;
    }
    // Every loop below is over at most 128 pairs, reading shared words all threads read at once.
    __shared__ int slot_s[kMaxPairs], lead[kMaxPairs], start_s[kMaxPairs];
    __shared__ uint32_t mask_s[kMaxPairs];
    const int TK = T * K;
    for (int p = threadIdx.x; p < TK; p += blockDim.x) slot_s[p] = res.slot(p);
    __syncthreads();
    // lead[p]: the first pair with p's slot (p itself when p opens a group), or -1 when p adds
    // nothing (not resident, or its token named that slot already); an opening pair also takes
    // the group's token mask (a token's repeat of the slot sets a bit already set).
    for (int p = threadIdx.x; p < TK; p += blockDim.x) {
        const int s = slot_s[p], t0 = p / K * K;
        int first = -1;
        bool again = false;
        for (int q = 0; q < p; ++q) {
            if (slot_s[q] != s) continue;
            if (first < 0) first = q;
            again |= q >= t0;
        }
        lead[p] = s < 0 || again ? -1 : (first < 0 ? p : first);
        if (skipped) skipped[p] = lead[p] < 0;
        if (s >= 0 && first < 0) {
            uint32_t m = 0;
            for (int q = p; q < TK; ++q)
                if (slot_s[q] == s) m |= 1u << (q / K);
            mask_s[p] = m;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < TK; p += blockDim.x) {
        if (lead[p] != p) continue;
        int u = 0, start = 0;
        for (int q = 0; q < p; ++q)
            if (lead[q] == q) ++u, start += __popc(mask_s[q]);
        g.slot[u] = slot_s[p];
        g.mask[u] = int32_t(mask_s[p]);
        g.start[u] = start;
        start_s[p] = start;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < TK; p += blockDim.x) {
        const int l = lead[p];
        g.row_of[p] = l < 0 ? -1 : start_s[l] + rank_in(mask_s[l], p / K);
    }
    if (threadIdx.x == 0) {
        int n = 0, rows = 0;
        for (int q = 0; q < TK; ++q) n += lead[q] == q, rows += lead[q] >= 0;
        g.count[0] = n;
        g.count[1] = rows;
    }
}

struct PoolView {
    const uint8_t* base;
    int64_t slot_bytes;
    uintptr_t lo, hi;  // bytes of the whole pool
};

// What the two rows-engine maps read of the groups.
struct GroupsView {
    const int32_t *count, *slot, *mask, *start;
    __device__ int n() const { return __ldg(count); }
    __device__ uint32_t tokens(int u) const { return uint32_t(__ldg(mask + u)); }
    __device__ int first_row(int u) const { return __ldg(start + u); }
    __device__ const uint8_t* rows_of(const PoolView& v, int u) const {
        return v.base + __ldg(slot + u) * v.slot_bytes;
    }
};

struct GateUpMap {
    static constexpr bool kCompactX = false;  // x holds one vector per token of the call
    PoolView pool0, pool1;  // NP = 1: pool0 only
    int NP, proj0;          // projections in this launch (1 or 2); gu index of pool0 (0 gate, 1 up)
    GroupsView grp;
    int64_t row_bytes;  // one row of H weights
    int F, G;
    FastDiv tiles_per;  // tiles of one projection of one group: ceil(F / G)
    XView x;    // [T] vectors in the policy's layout (group_kernel)
    float* gu;  // [rows][2][F]

    __device__ int n_tiles() const { return grp.n() * NP * int(tiles_per.d); }
    __device__ int rows_per_tile() const { return G; }
    __device__ void split(int tile, int& u, int& pr, int& rg) const {
        const int q = tiles_per.div(tile);
        rg = tile - q * int(tiles_per.d);
        pr = NP == 2 ? q & 1 : 0;
        u = NP == 2 ? q >> 1 : q;
    }
    __device__ uint32_t tile_mask(int tile) const {
        const int q = tiles_per.div(tile);
        return grp.tokens(NP == 2 ? q >> 1 : q);
    }
    __device__ bool row(int tile, int i, Seg& s) const {
        int u, pr, rg;
        split(tile, u, pr, rg);
        const int f = rg * G + i;
        if (f >= F) return false;
        const PoolView& v = pr == 0 ? pool0 : pool1;
        s.ptr = grp.rows_of(v, u) + f * row_bytes;
        s.lo = v.lo;
        s.hi = v.hi;
        s.xvec = 0;
        return true;
    }
    template <int NT> __device__ void store(int tile, int i, const float (&acc)[NT]) const {
        int u, pr, rg;
        split(tile, u, pr, rg);
        const uint32_t m = grp.tokens(u);
        const int r0 = grp.first_row(u);
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if ((m >> t) & 1)
                gu[(size_t(r0 + rank_in(m, t)) * 2 + proj0 + pr) * F + rg * G + i] = acc[t];
    }
    template <class Pol> __device__ void prep(uint8_t*) const {}
    __device__ XView xview(const uint8_t*) const { return x; }
};

struct DownMap {
    static constexpr bool kCompactX = true;  // act holds one vector per row, a group's together
    PoolView pool;
    GroupsView grp;
    int64_t row_bytes;  // one row of F weights
    int H, G;
    FastDiv tiles_per;  // tiles of one group: ceil(H / G)
    XView act;    // [TK] vectors in the policy's layout (act_kernel)
    float* part;  // [rows][H]

    __device__ int n_tiles() const { return grp.n() * int(tiles_per.d); }
    __device__ int rows_per_tile() const { return G; }
    __device__ uint32_t tile_mask(int tile) const { return grp.tokens(tiles_per.div(tile)); }
    __device__ bool row(int tile, int i, Seg& s) const {
        const int u = tiles_per.div(tile), h = (tile - u * int(tiles_per.d)) * G + i;
        if (h >= H) return false;
        s.ptr = grp.rows_of(pool, u) + h * row_bytes;
        s.lo = pool.lo;
        s.hi = pool.hi;
        s.xvec = grp.first_row(u);
        return true;
    }
    template <int NT> __device__ void store(int tile, int i, const float (&acc)[NT]) const {
        const int u = tiles_per.div(tile), h = (tile - u * int(tiles_per.d)) * G + i;
        const uint32_t m = grp.tokens(u);
        const int r0 = grp.first_row(u);
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if ((m >> t) & 1) part[size_t(r0 + rank_in(m, t)) * H + h] = acc[t];
    }
    template <class Pol> __device__ void prep(uint8_t*) const {}
    __device__ XView xview(const uint8_t*) const { return act; }
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// CTA b: rows b*K .. b*K + K - 1 (those that exist): h = silu(gate) * up, in the down policy's layout.
template <bool Q8>
__global__ void __launch_bounds__(kThreads)
act_kernel(const float* __restrict__ gu, const int32_t* count, int F, int K, int TK, uint8_t* act) {
    const int r0 = blockIdx.x * K, n = min(K, __ldg(count + 1) - r0);
    if (n <= 0) return;
    const int ng = F / 32;
    auto load = [&](int v, int g, int j) -> float4 {
        const float* gp = gu + size_t(r0 + v) * 2 * F + 32 * g + 4 * j;
        const float4 a = *reinterpret_cast<const float4*>(gp);
        const float4 b = *reinterpret_cast<const float4*>(gp + F);
        return make_float4(silu(a.x) * b.x, silu(a.y) * b.y, silu(a.z) * b.z, silu(a.w) * b.w);
    };
    if constexpr (Q8)
        prep_x_q8(load, n, ng, act + size_t(r0) * ng * 32,
                  reinterpret_cast<float2*>(act + size_t(TK) * ng * 32) + size_t(r0) * ng);
    else
        prep_x_f32(load, n, ng, reinterpret_cast<float*>(act) + size_t(r0) * ng * 36);
}

// y[t][h] (+)= sum over k in order of weights[t,k] * part[row_of[t,k]][h]; blockIdx.y = token.
__global__ void __launch_bounds__(kThreads)
sum_kernel(const float* __restrict__ part, const int32_t* row_of, const float* weights, int H, int K,
           float* y, bool accumulate) {
    const int t = blockIdx.y, h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= H) return;
    float s = 0.f;
    for (int k = 0; k < K; ++k) {
        const int r = __ldg(row_of + t * K + k);
        if (r >= 0) s = fmaf(__ldg(weights + t * K + k), part[size_t(r) * H + h], s);
    }
    float* out = y + size_t(t) * H + h;
    *out = accumulate ? *out + s : s;
}

// Where each part of a call lives in scratch (byte offsets, 256-aligned).
struct Layout {
    int64_t groups, xq8, xf32, gu, act, part, total;
};

Layout layout_of(int64_t T, int64_t K, int64_t F, int64_t H) {
    auto al = [](int64_t b) { return cdiv(b, 256) * 256; };
    const int64_t TK = T * K;
    Layout l{};
    int64_t o = 0;
    l.groups = o, o += al((2 + 4 * TK) * 4);
    l.xq8 = o, o += al(T * (H / 32) * 40);
    l.xf32 = o, o += al(T * (H / 32) * 144);
    l.gu = o, o += al(TK * 2 * F * 4);
    l.act = o, o += al(TK * (F / 32) * 144);
    l.part = o, o += al(TK * H * 4);
    l.total = o;
    return l;
}

PoolView pool_view(const Pool& p, int64_t n_slots, int64_t rows, int64_t row_bytes) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p.base);
    return {static_cast<const uint8_t*>(p.base), p.slot_bytes, lo,
            lo + uintptr_t((n_slots - 1) * p.slot_bytes + rows * row_bytes)};
}

// Row geometry and checks of one projection: rows of `cols` weights, `rows` rows per slot.
template <QType QT> int64_t proj_row_bytes(const Pool& p, int64_t rows, int64_t cols, const char* what) {
    using Tr = Traits<QT>;
    require(cols % Tr::kb_elems == 0, std::string("moe_ffn: ") + what + " " + Tr::name + " rows of " +
                                          std::to_string(cols) + " weights are not whole blocks");
    const int64_t rb = cols / Tr::kb_elems * Tr::kb_bytes;
    require(p.slot_bytes >= rows * rb, std::string("moe_ffn: ") + what + " slot_bytes " +
                                           std::to_string(p.slot_bytes) + " < one expert's " +
                                           std::to_string(rows * rb) + " bytes");
    check_alignment<PolicyFor<QT>>(p.base, p.slot_bytes, what);
    return rb;
}

// The rows engine at the fewest token slots that hold T tokens (1 or 8: a mask skips the rest),
// over `groups` groups (an upper bound: the device knows how many) of `rows` rows. A tile is the
// chunk's rows (m.G = Geom G * RB): each map splits tile indices by the tiles of a group.
template <class Pol, int NT, int RB, class Map>
void launch_grouped_rb(Map m, int64_t nkb, int64_t rows, int64_t groups, cudaStream_t st) {
    const Geom geo = make_geom<Pol>(nkb, 0, RB);
    m.G = geo.G * RB;
    m.tiles_per = FastDiv(uint32_t(cdiv(rows, m.G)));
    launch_rows<Pol, NT, RB>(m, geo, groups * cdiv(rows, m.G), m.G, 1, st);
}
// Row blocks from 4 tokens on: at 2 and 3 the 8-slot kernel's registers cost more than the
// shared x reads save (moe_pool_bench.py: T = 2 51.6 -> 54.8 us, T = 4 86.3 -> 81.4, distinct).
template <class Pol, class Map>
void launch_grouped(const Map& m, int64_t nkb, int64_t rows, int64_t groups, int T, cudaStream_t st) {
    if (T == 1) return launch_grouped_rb<Pol, 1, 1>(m, nkb, rows, groups, st);
    if constexpr (max_row_blocks<Pol, kMaxTok>() == 2) {
        const int G = make_geom<Pol>(nkb, 0).G;
        if (T >= 4 && blocked_rows_pay(groups * cdiv(rows, int64_t(2) * G)))
            return launch_grouped_rb<Pol, kMaxTok, 2>(m, nkb, rows, groups, st);
    }
    launch_grouped_rb<Pol, kMaxTok, 1>(m, nkb, rows, groups, st);
}

// A call's device pointers.
struct Call {
    Groups g;
    GroupsView view() const { return {g.count, g.slot, g.mask, g.start}; }
    uint8_t *xq8, *act;
    float *xf32, *gu, *part;
};

template <QType QT>
void launch_gate_up(const Pool& a, const Pool* b, int proj0, const Call& c, int64_t n_slots, int T,
                    int K, int64_t H, int64_t F, cudaStream_t st) {
    using Pol = PolicyFor<QT>;
    const int64_t rb = proj_row_bytes<QT>(a, F, H, proj0 == 0 ? "gate" : "up");
    if (b) proj_row_bytes<QT>(*b, F, H, "up");
    const int ng = int(H / 32);
    GateUpMap m{};
    m.pool0 = pool_view(a, n_slots, F, rb);
    m.pool1 = b ? pool_view(*b, n_slots, F, rb) : m.pool0;
    m.NP = b ? 2 : 1;
    m.proj0 = proj0;
    m.grp = c.view();
    m.row_bytes = rb;
    m.F = int(F);
    m.x = Pol::kQ8 ? XView{c.xq8, ng, T} : XView{reinterpret_cast<const uint8_t*>(c.xf32), ng, T};
    m.gu = c.gu;
    launch_grouped<Pol>(m, H / Traits<QT>::kb_elems, F, int64_t(T) * K * m.NP, T, st);
}

template <QType QT>
void launch_act_down(const Pool& d, const Call& c, int64_t n_slots, int T, int K, int64_t H,
                     int64_t F, cudaStream_t st) {
    using Pol = PolicyFor<QT>;
    const int64_t rb = proj_row_bytes<QT>(d, H, F, "down");
    const int ng = int(F / 32);
    auto act_k = act_kernel<Pol::kQ8>;
    FT_LAUNCH(act_k, dim3(unsigned(T)), kThreads, 0, st, c.gu, c.g.count, int(F), K, T * K, c.act);
    check_launch("act_kernel");
    DownMap m{};
    m.pool = pool_view(d, n_slots, H, rb);
    m.grp = c.view();
    m.row_bytes = rb;
    m.H = int(H);
    m.act = XView{c.act, ng, T * K};
    m.part = c.part;
    launch_grouped<Pol>(m, F / Traits<QT>::kb_elems, H, int64_t(T) * K, T, st);
}

int type_of(int id, const char* what) {
    require(visit_type(id, [](auto) {}), std::string("moe_ffn: unknown ggml type id for ") + what +
                                             ": " + std::to_string(id));
    return id;
}

}  // namespace

int64_t moe_scratch_bytes(int64_t n_tok, int64_t top_k, int64_t ff, int64_t hidden) {
    const int64_t T = n_tok < kMaxTok ? n_tok : kMaxTok;
    return layout_of(T, top_k, ff, hidden).total;
}

void moe_ffn_pool(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, const int32_t* ids,
                  const float* weights, int64_t top_k, const int32_t* slot_of_expert,
                  int64_t n_experts, int64_t n_slots, const Pool& gate, const Pool& up,
                  const Pool& down, float* y, bool accumulate, int32_t* skipped, void* scratch,
                  int64_t scratch_bytes, uintptr_t stream) {
    require(n_tok >= 0 && n_tok <= kMaxTok, "moe_ffn_pool: n_tok must be 0..8 (call per 8 tokens)");
    require(top_k >= 1 && top_k <= kMaxTopK, "moe_ffn_pool: top_k must be 1..16");
    require(hidden > 0 && hidden % 32 == 0 && ff > 0 && ff % 32 == 0,
            "moe_ffn_pool: hidden and ff must be positive multiples of 32");
    require(hidden < (int64_t(1) << 24) && ff < (int64_t(1) << 24), "moe_ffn_pool: shape too large");
    require(n_experts >= 0 && n_slots >= 0, "moe_ffn_pool: negative expert or slot count");
    type_of(gate.type_id, "gate");
    type_of(up.type_id, "up");
    type_of(down.type_id, "down");
    if (n_tok == 0) return;
    const int64_t need = moe_scratch_bytes(n_tok, top_k, ff, hidden);
    require(scratch_bytes >= need, "moe_ffn_pool: scratch needs " + std::to_string(need) +
                                       " bytes, got " + std::to_string(scratch_bytes));
    require(reinterpret_cast<uintptr_t>(scratch) % 16 == 0, "moe_ffn_pool: scratch must be 16-byte aligned");
    const int T = int(n_tok), K = int(top_k), TK = T * K;
    const cudaStream_t st = to_stream(stream);
    const Layout l = layout_of(T, K, ff, hidden);
    uint8_t* base = static_cast<uint8_t*>(scratch);
    int32_t* gw = reinterpret_cast<int32_t*>(base + l.groups);
    Call c{};
    c.g = Groups{gw, gw + 2, gw + 2 + TK, gw + 2 + 2 * TK, gw + 2 + 3 * TK};
    c.xq8 = base + l.xq8;
    c.xf32 = reinterpret_cast<float*>(base + l.xf32);
    c.gu = reinterpret_cast<float*>(base + l.gu);
    c.act = base + l.act;
    c.part = reinterpret_cast<float*>(base + l.part);
    const Residency res{ids, slot_of_expert, int(n_experts), int(n_slots)};
    const int64_t slots = n_slots > 0 ? n_slots : 1;

    bool q8 = false, f32 = false;  // the x layouts gate and up read
    for (int id : {gate.type_id, up.type_id})
        visit_type(id, [&](auto tag) { (uses_q8<decltype(tag)::type>() ? q8 : f32) = true; });
    const GlobalX gx{x, hidden, reinterpret_cast<uintptr_t>(x) % 16 == 0 && hidden % 4 == 0};
    auto group_k = q8 && f32 ? group_kernel<true, true> : q8 ? group_kernel<true, false>
                                                             : group_kernel<false, true>;
    FT_LAUNCH(group_k, dim3(unsigned(T + 1)), kThreads, 0, st, res, T, K, gx, int(hidden / 32), c.g,
              c.xq8, c.xf32, skipped);
    check_launch("group_kernel");

    if (gate.type_id == up.type_id) {
        visit_type(gate.type_id, [&](auto tag) {
            launch_gate_up<decltype(tag)::type>(gate, &up, 0, c, slots, T, K, hidden, ff, st);
        });
    } else {
        visit_type(gate.type_id, [&](auto tag) {
            launch_gate_up<decltype(tag)::type>(gate, nullptr, 0, c, slots, T, K, hidden, ff, st);
        });
        visit_type(up.type_id, [&](auto tag) {
            launch_gate_up<decltype(tag)::type>(up, nullptr, 1, c, slots, T, K, hidden, ff, st);
        });
    }
    visit_type(down.type_id, [&](auto tag) {
        launch_act_down<decltype(tag)::type>(down, c, slots, T, K, hidden, ff, st);
    });
    FT_LAUNCH(sum_kernel, dim3(unsigned(cdiv(hidden, kThreads)), unsigned(T)), kThreads, 0, st, c.part,
              c.g.row_of, weights, int(hidden), K, y, accumulate);
    check_launch("sum_kernel");
}

void moe_ffn(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             const int32_t* ids, const float* weights, int64_t top_k, const Pool& gate,
             const Pool& up, const Pool& down, float* y, uintptr_t stream) {
    if (n_tok <= 0) return;
    const cudaStream_t st = to_stream(stream);
    const int64_t bytes = moe_scratch_bytes(n_tok, top_k, ff, hidden);
    void* scratch = nullptr;
    FT_CUDA_CHECK(cudaMallocAsync(&scratch, size_t(bytes), st));
    try {
        for (int64_t t0 = 0; t0 < n_tok; t0 += kMaxTok) {
            const int64_t T = n_tok - t0 < kMaxTok ? n_tok - t0 : kMaxTok;
            moe_ffn_pool(x + t0 * hidden, T, hidden, ff, ids + t0 * top_k, weights + t0 * top_k,
                         top_k, nullptr, n_experts, n_experts, gate, up, down, y + t0 * hidden,
                         false, nullptr, scratch, bytes, stream);
        }
    } catch (...) {
        cudaFreeAsync(scratch, st);
        throw;
    }
    FT_CUDA_CHECK(cudaFreeAsync(scratch, st));
}

}  // namespace ft::cuda
