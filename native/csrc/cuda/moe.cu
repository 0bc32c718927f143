// Routed experts over a device-resident slot pool, for decode (T <= 8 tokens per launch group).
// MoE legend: T tokens, K top-k, E experts, H hidden, F expert ff; pair p = t*K + k.
//
//   1. gate/up  rows engine, tile = (pair, projection, rows): gu[p][0|1][f] = W[slot] row f . x_t
//               (one launch for both projections when they share a type, else one each)
//   2. act      one CTA per token: h = silu(gate) * up per pair, written in the down policy's
//               x layout (int8 + scales, or padded f32); skipped[t,k] = expert not resident
//   3. down     rows engine, tile = (token, hidden row h): y[t][h] = sum_k w[t,k] * W[slot_k] row h . h_p
//               (K expert rows summed by one warp: deterministic, no atomics, y fully written)
//
// The residency lookup (ids -> slot_of_expert -> slot) happens on the device in every kernel, so
// the host never waits for routing. Scratch (moe_scratch_bytes): gu f32 [T*K][2][F] at 0, the act
// vectors after it (256-byte aligned). All kernels go to `stream`; nothing syncs or allocates
// (moe_ffn, the native._cpu-compatible entry, takes its scratch from cudaMallocAsync).
#include "cuda/rows.cuh"

namespace ft::cuda {
namespace {

constexpr int kMaxTok = 8, kMaxTopK = 16;

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

struct PoolView {
    const uint8_t* base;
    int64_t slot_bytes;
    uintptr_t lo, hi;  // bytes of the whole pool
};

struct GateUpMap {
    static constexpr bool kSingle = false;
    PoolView pool0, pool1;  // NP = 1: pool0 only
    int NP, proj0;          // projections in this launch; gu index of pool0 (0 gate, 1 up)
    Residency res;
    int64_t row_bytes;  // one row of H weights
    int F, G, K, TK, T, ng;
    GlobalX x;  // [T, H]
    float* gu;  // [TK][2][F]

    __device__ int tiles_per() const { return (F + G - 1) / G; }
    __device__ int n_tiles() const { return TK * NP * tiles_per(); }
    __device__ int rows_per_tile() const { return G; }
    __device__ int nt() const { return 1; }
    __device__ void split(int tile, int& p, int& pr, int& rg) const {
        const int tp = tiles_per(), q = tile / tp;
        rg = tile - q * tp;
        pr = q % NP;
        p = q / NP;
    }
    __device__ bool row(int tile, int i, Seg& s) const {
        int p, pr, rg;
        split(tile, p, pr, rg);
        const int f = rg * G + i;
        if (f >= F) return false;
        const int sl = res.slot(p);
        if (sl < 0) return false;
        const PoolView& v = pr == 0 ? pool0 : pool1;
        s.ptr = v.base + sl * v.slot_bytes + f * row_bytes;
        s.lo = v.lo;
        s.hi = v.hi;
        s.xvec = p / K;
        s.scale = 1.f;
        return true;
    }
    template <int NT> __device__ void store(int tile, int i, const float (&acc)[NT]) const {
        int p, pr, rg;
        split(tile, p, pr, rg);
        gu[(size_t(p) * 2 + proj0 + pr) * F + rg * G + i] = acc[0];
    }
    template <class Pol> __device__ void prep(uint8_t* xs) const { prep_x<Pol>(x, T, ng, xs); }
    __device__ XView xview(const uint8_t* xs) const { return {xs, ng, T}; }
};

// Block-cooperative copy of `bytes` (a multiple of 8, both ends 8-aligned).
__device__ void block_copy8(uint8_t* dst, const uint8_t* src, size_t bytes) {
    for (size_t i = threadIdx.x; i < bytes / 8; i += blockDim.x)
        reinterpret_cast<uint2*>(dst)[i] = __ldg(reinterpret_cast<const uint2*>(src) + i);
}

struct DownMap {  // blockIdx.y = token
    static constexpr bool kSingle = true;
    PoolView pool;
    Residency res;
    int64_t row_bytes;  // one row of F weights
    int H, K, TK, ng;
    const float* weights;  // [T*K]
    const uint8_t* act;    // TK vectors of ng groups in the policy's layout
    float* y;              // [T, H]
    bool accumulate;       // y += (a second launch over other pairs), else y =

    __device__ int n_tiles() const { return H; }
    __device__ int rows_per_tile() const { return K; }
    __device__ int nt() const { return 1; }
    __device__ bool row(int h, int k, Seg& s) const {
        const int p = blockIdx.y * K + k;
        const int sl = res.slot(p);
        if (sl < 0) return false;
        s.ptr = pool.base + sl * pool.slot_bytes + h * row_bytes;
        s.lo = pool.lo;
        s.hi = pool.hi;
        s.xvec = k;
        s.scale = __ldg(weights + p);
        return true;
    }
    template <int NT> __device__ void store(int h, int, const float (&acc)[NT]) const {
        float* out = y + size_t(blockIdx.y) * H + h;
        *out = accumulate ? *out + acc[0] : acc[0];
    }
    template <class Pol> __device__ void prep(uint8_t* xs) const {
        const size_t p0 = size_t(blockIdx.y) * K;
        if constexpr (Pol::kQ8) {
            block_copy8(xs, act + p0 * ng * 32, size_t(K) * ng * 32);
            block_copy8(xs + size_t(K) * ng * 32, act + size_t(TK) * ng * 32 + p0 * ng * 8,
                        size_t(K) * ng * 8);
        } else {
            block_copy8(xs, act + p0 * ng * 144, size_t(K) * ng * 144);
        }
    }
    __device__ XView xview(const uint8_t* xs) const { return {xs, ng, K}; }
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// One CTA per token: h_p = silu(gu[p][0]) * gu[p][1] for its K pairs, in the down policy's layout.
template <bool Q8>
__global__ void __launch_bounds__(kThreads)
act_kernel(const float* __restrict__ gu, Residency res, int F, int K, int TK, uint8_t* act,
           int32_t* skipped) {
    __shared__ int resident[kMaxTopK];
    const int t = blockIdx.x;
    if (int(threadIdx.x) < K) {
        const int p = t * K + threadIdx.x;
        const bool r = res.slot(p) >= 0;
        resident[threadIdx.x] = r;
        if (skipped) skipped[p] = r ? 0 : 1;
    }
    __syncthreads();
    const int ng = F / 32;
    auto load = [&](int v, int g, int j) -> float4 {
        if (!resident[v]) return make_float4(0.f, 0.f, 0.f, 0.f);
        const float* gp = gu + size_t(t * K + v) * 2 * F + 32 * g + 4 * j;
        const float4 a = *reinterpret_cast<const float4*>(gp);
        const float4 b = *reinterpret_cast<const float4*>(gp + F);
        return make_float4(silu(a.x) * b.x, silu(a.y) * b.y, silu(a.z) * b.z, silu(a.w) * b.w);
    };
    const size_t p0 = size_t(t) * K;
    if constexpr (Q8)
        prep_x_q8(load, K, ng, act + p0 * ng * 32,
                  reinterpret_cast<float2*>(act + size_t(TK) * ng * 32) + p0 * ng);
    else
        prep_x_f32(load, K, ng, reinterpret_cast<float*>(act) + p0 * ng * 36);
}

int64_t gu_bytes(int64_t T, int64_t K, int64_t F) { return cdiv(T * K * 2 * F * 4, 256) * 256; }

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

template <QType QT>
void launch_gate_up(const Pool& a, const Pool* b, int proj0, const Residency& res, int64_t n_slots,
                    const float* x, int T, int K, int64_t H, int64_t F, float* gu, cudaStream_t st) {
    using Pol = PolicyFor<QT>;
    const int64_t rb = proj_row_bytes<QT>(a, F, H, proj0 == 0 ? "gate" : "up");
    if (b) proj_row_bytes<QT>(*b, F, H, "up");
    const int ng = int(H / 32);
    const Geom geo = make_geom<Pol>(H / Traits<QT>::kb_elems, x_bytes<Pol>(T, ng));
    GateUpMap m{};
    m.pool0 = pool_view(a, n_slots, F, rb);
    m.pool1 = b ? pool_view(*b, n_slots, F, rb) : m.pool0;
    m.NP = b ? 2 : 1;
    m.proj0 = proj0;
    m.res = res;
    m.row_bytes = rb;
    m.F = int(F);
    m.G = geo.G;
    m.K = K;
    m.TK = T * K;
    m.T = T;
    m.ng = ng;
    m.x = GlobalX{x, H, reinterpret_cast<uintptr_t>(x) % 16 == 0 && H % 4 == 0};
    m.gu = gu;
    launch_rows<Pol, 1>(m, geo, int64_t(T) * K * m.NP * cdiv(F, geo.G), geo.G, 1, st);
}

template <QType QT>
void launch_act_down(const Pool& d, const Residency& res, int64_t n_slots, const float* weights,
                     int T, int K, int64_t H, int64_t F, const float* gu, uint8_t* act, float* y,
                     bool accumulate, int32_t* skipped, cudaStream_t st) {
    using Pol = PolicyFor<QT>;
    const int64_t rb = proj_row_bytes<QT>(d, H, F, "down");
    const int ng = int(F / 32);
    auto act_k = act_kernel<Pol::kQ8>;
    FT_LAUNCH(act_k, dim3(unsigned(T)), kThreads, 0, st, gu, res, int(F), K, T * K, act, skipped);
    check_launch("act_kernel");
    const Geom geo = make_geom<Pol>(F / Traits<QT>::kb_elems, x_bytes<Pol>(K, ng));
    DownMap m{};
    m.pool = pool_view(d, n_slots, H, rb);
    m.res = res;
    m.row_bytes = rb;
    m.H = int(H);
    m.K = K;
    m.TK = T * K;
    m.ng = ng;
    m.weights = weights;
    m.act = act;
    m.y = y;
    m.accumulate = accumulate;
    launch_rows<Pol, 1>(m, geo, H, K, T, st);
}

int type_of(int id, const char* what) {
    require(visit_type(id, [](auto) {}), std::string("moe_ffn: unknown ggml type id for ") + what +
                                             ": " + std::to_string(id));
    return id;
}

}  // namespace

int64_t moe_scratch_bytes(int64_t n_tok, int64_t top_k, int64_t ff) {
    const int64_t T = n_tok < kMaxTok ? n_tok : kMaxTok;
    return gu_bytes(T, top_k, ff) + T * top_k * (ff / 32) * 144;
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
    require(scratch_bytes >= moe_scratch_bytes(n_tok, top_k, ff),
            "moe_ffn_pool: scratch needs " + std::to_string(moe_scratch_bytes(n_tok, top_k, ff)) +
                " bytes, got " + std::to_string(scratch_bytes));
    require(reinterpret_cast<uintptr_t>(scratch) % 16 == 0, "moe_ffn_pool: scratch must be 16-byte aligned");
    const int T = int(n_tok), K = int(top_k);
    const cudaStream_t st = to_stream(stream);
    float* gu = static_cast<float*>(scratch);
    uint8_t* act = static_cast<uint8_t*>(scratch) + gu_bytes(T, K, ff);
    const Residency res{ids, slot_of_expert, int(n_experts), int(n_slots)};
    const int64_t slots = n_slots > 0 ? n_slots : 1;

    if (gate.type_id == up.type_id) {
        visit_type(gate.type_id, [&](auto tag) {
            launch_gate_up<decltype(tag)::type>(gate, &up, 0, res, slots, x, T, K, hidden, ff, gu, st);
        });
    } else {
        visit_type(gate.type_id, [&](auto tag) {
            launch_gate_up<decltype(tag)::type>(gate, nullptr, 0, res, slots, x, T, K, hidden, ff, gu, st);
        });
        visit_type(up.type_id, [&](auto tag) {
            launch_gate_up<decltype(tag)::type>(up, nullptr, 1, res, slots, x, T, K, hidden, ff, gu, st);
        });
    }
    visit_type(down.type_id, [&](auto tag) {
        launch_act_down<decltype(tag)::type>(down, res, slots, weights, T, K, hidden, ff, gu, act, y,
                                             accumulate, skipped, st);
    });
}

void moe_ffn(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             const int32_t* ids, const float* weights, int64_t top_k, const Pool& gate,
             const Pool& up, const Pool& down, float* y, uintptr_t stream) {
    if (n_tok <= 0) return;
    const cudaStream_t st = to_stream(stream);
    const int64_t bytes = moe_scratch_bytes(n_tok, top_k, ff);
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
