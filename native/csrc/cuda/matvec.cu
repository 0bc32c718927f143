// matmul for decode: y [T, O] = x [T, H] @ W [O, H]^T straight from the blocks, 1..8 tokens per
// launch (rows.cuh explains the engine). Every type of FT_QUANT_TYPES is instantiated for
// NT = 1, 2, 4, 8 token slots (a launch with T tokens uses the smallest NT >= T).
//
// Stream behaviour: enqueues one kernel per group of up to 8 tokens on `stream`; no host sync, no
// allocation; capturable. x is read (and for q8 types rounded to int8) by every CTA into shared
// memory, so T * H * 1.25 bytes (q8) or T * H * 4.5 bytes (f32) must fit next to the stages;
// larger T are split into more launches.
#include <atomic>
#include <cstdlib>

#include "cuda/rows.cuh"

namespace ft::cuda {
namespace {

// Tile = G consecutive output rows (the chunk's rows: Geom G * RB).
struct PlainMap {
    static constexpr bool kCompactX = false;
    const uint8_t* w;
    int64_t row_stride;
    uintptr_t lo, hi;
    int O, G, T, ng;
    GlobalX x;
    float* y;
    int64_t ldy;

    __device__ int n_tiles() const { return (O + G - 1) / G; }
    __device__ int rows_per_tile() const { return G; }
    __device__ uint32_t tile_mask(int) const { return (1u << T) - 1u; }
    __device__ bool row(int tile, int i, Seg& s) const {
        const int r = tile * G + i;
        if (r >= O) return false;
        s.ptr = w + r * row_stride;
        s.lo = lo;
        s.hi = hi;
        s.xvec = 0;
        return true;
    }
    template <int NT> __device__ void store(int tile, int i, const float (&acc)[NT]) const {
        const int r = tile * G + i;
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (t < T) y[t * ldy + r] = acc[t];
    }
    template <class Pol> __device__ void prep(uint8_t* xs) const { prep_x<Pol>(x, T, ng, xs); }
    __device__ XView xview(const uint8_t* xs) const { return {xs, ng, T}; }
};

template <class Pol, int NT, int RB>
void launch_plain_rb(PlainMap m, int64_t nkb, int ng, cudaStream_t stream) {
    const Geom geo = make_geom<Pol>(nkb, x_bytes<Pol>(m.T, ng), RB, NT == 1 && two_units_pay(m.O));
    m.G = geo.G * RB;
    if constexpr (NT == 1 && two_units_fit<Pol>()) {   // the geometry says whether it took 64 units
        if (geo.G == 1 && geo.bpc * Pol::kSubs > 32)
            return launch_rows<Pol, NT, RB, PlainMap, 2>(m, geo, cdiv(m.O, m.G), m.G, 1, stream);
    }
    launch_rows<Pol, NT, RB>(m, geo, cdiv(m.O, m.G), m.G, 1, stream);
}

template <class Pol, int NT>
void launch_plain(const PlainMap& m, int64_t nkb, int ng, cudaStream_t stream) {
    if constexpr (max_row_blocks<Pol, NT>() == 2) {
        const int G = make_geom<Pol>(nkb, 0).G;
        if (blocked_rows_pay(cdiv(m.O, 2 * G))) return launch_plain_rb<Pol, NT, 2>(m, nkb, ng, stream);
    }
    launch_plain_rb<Pol, NT, 1>(m, nkb, ng, stream);
}

template <QType QT>
void matmul_typed(const uint8_t* w, int64_t n_out, int64_t n_in, int64_t stride, const float* x,
                  int64_t n_tok, float* y, cudaStream_t stream) {
    using Pol = PolicyFor<QT>;
    using Tr = Traits<QT>;
    require(n_in % Tr::kb_elems == 0,
            std::string("matmul: ") + Tr::name + " rows of " + std::to_string(n_in) +
                " weights are not whole blocks of " + std::to_string(Tr::kb_elems));
    const int64_t nkb = n_in / Tr::kb_elems;
    require(stride >= nkb * Tr::kb_bytes, "matmul: weight row stride is shorter than a row");
    require(n_out < (int64_t(1) << 31) / 2 && n_in < (int64_t(1) << 24), "matmul: shape too large");
    check_alignment<Pol>(w, stride, "matmul");
    if (n_tok <= 0 || n_out <= 0) return;

    const int ng = int(n_in / 32);
    const int per_launch = fit_vectors<Pol>(nkb, ng, int(n_tok < 8 ? n_tok : 8), max_row_blocks<Pol, 8>());
    const uintptr_t lo = reinterpret_cast<uintptr_t>(w);
    const uintptr_t hi = lo + uintptr_t((n_out - 1) * stride + nkb * Tr::kb_bytes);
    for (int64_t t0 = 0; t0 < n_tok; t0 += per_launch) {
        const int T = int(n_tok - t0 < per_launch ? n_tok - t0 : per_launch);
        const float* xt = x + t0 * n_in;
        const bool aligned = reinterpret_cast<uintptr_t>(xt) % 16 == 0 && n_in % 4 == 0;
        PlainMap m{w, stride, lo, hi, int(n_out), 1, T, ng, GlobalX{xt, n_in, aligned},
                   y + t0 * n_out, n_out};
        if (T == 1) launch_plain<Pol, 1>(m, nkb, ng, stream);
        else if (T == 2) launch_plain<Pol, 2>(m, nkb, ng, stream);
        else if (T <= 4) launch_plain<Pol, 4>(m, nkb, ng, stream);
        else launch_plain<Pol, 8>(m, nkb, ng, stream);
    }
}

}  // namespace

void matmul(int type_id, const void* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
            const float* x, int64_t n_tok, float* y, uintptr_t stream) {
    const bool known = visit_type(type_id, [&](auto tag) {
        matmul_typed<decltype(tag)::type>(static_cast<const uint8_t*>(w), n_out, n_in, w_row_stride,
                                          x, n_tok, y, to_stream(stream));
    });
    require(known, "matmul: unknown ggml type id " + std::to_string(type_id));
}

std::string matmul_accum(int type_id) {
    std::string out;
    visit_type(type_id, [&](auto tag) { out = uses_q8<decltype(tag)::type>() ? "q8" : "f32"; });
    return out;
}

int grid_copies() {
    if (const char* env = std::getenv("FTPATCH_IQ_GRID_COPIES")) {
        const int v = std::atoi(env);
        require(v >= 1 && v <= 32 && (v & (v - 1)) == 0,
                "FTPATCH_IQ_GRID_COPIES must be 1, 2, 4, 8, 16 or 32");
        return v;
    }
    // One copy: measured on the H200 (2026-11-29, IQ3_S, T=1) faster than 4 or 16 at every model
    // shape (2048x512: 35 vs 22/26 GB/s; 2048x248320: 938 vs 933/874): filling the copies costs
    // more per block than the bank conflicts they avoid.
    return 1;
}

namespace {
std::atomic<int> g_min_chunks{0};   // 0: not yet read from the environment
}

int rows_min_chunks() {
    int v = g_min_chunks.load();
    if (v > 0) return v;
    // 4: on the H200 (35B IQ3_S, T=1, in CUDA graphs) the expert FFN of 8 experts took 30.3 us
    // against 31.3 at 1, attn_qkv [8192, 2048] 12.1 against 14.0; 8 and more were slower
    v = 4;
    if (const char* env = std::getenv("FTPATCH_ROWS_MIN_CHUNKS")) {
        v = std::atoi(env);
        require(v >= 1 && v <= 1024, "FTPATCH_ROWS_MIN_CHUNKS must be 1..1024");
    }
    g_min_chunks.store(v);
    return v;
}

void set_rows_min_chunks(int n) {
    require(n >= 1 && n <= 1024, "rows min chunks must be 1..1024");
    g_min_chunks.store(n);
}

namespace {
std::atomic<int> g_row_blocking{-1};   // -1: not yet read from the environment
}

int row_blocking() {
    int v = g_row_blocking.load();
    if (v >= 0) return v;
    v = 0;
    if (const char* env = std::getenv("FTPATCH_ROW_BLOCKS")) {
        const std::string s(env);
        require(s == "auto" || s == "1" || s == "2", "FTPATCH_ROW_BLOCKS must be auto, 1 or 2");
        v = s == "auto" ? 0 : std::atoi(env);
    }
    g_row_blocking.store(v);
    return v;
}

void set_row_blocking(int mode) {
    require(mode >= 0 && mode <= 2, "row blocking must be 0 (where it pays), 1 (never) or 2 (always)");
    g_row_blocking.store(mode);
}

int ctas_per_sm(const void* kernel, size_t smem) {
    static std::mutex mu;
    static std::map<std::tuple<int, const void*, size_t>, int> cache;
    int dev = 0;
    FT_CUDA_CHECK(cudaGetDevice(&dev));
    const auto key = std::make_tuple(dev, kernel, smem);
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    int n = 0;
    FT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem));
    n = n < 1 ? 1 : n;
    cache.emplace(key, n);
    return n;
}

}  // namespace ft::cuda
