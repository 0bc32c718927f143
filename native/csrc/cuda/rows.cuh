// The rows engine shared by matmul (matvec.cu) and the expert-pool FFN (moe.cu).
//
// Work is a list of *tiles*; a tile is R weight rows (R = Map::rows_per_tile), each its own output
// for every token of the tile's token mask (a matmul: all T tokens; an expert group: the tokens
// that chose that expert). A warp owns whole tiles (tile = warp id + i * total warps: a persistent
// grid) and streams their rows through its own ring of S shared-memory stages with 16-byte
// cp.async copies (coalesced: lane l copies bytes [16l, 16l+16) of a chunk), so every weight byte
// crosses DRAM once, in full sectors, with S-1 chunks in flight per warp, whatever the block size
// (110-byte IQ3_S blocks included). A chunk is 32 units of 32 weights: 32/subs blocks of one row
// (64 units for long rows of small blocks: make_geom), or, for rows shorter than 32 units, G whole
// rows side by side (P = 32/G lanes each). Lane l decodes unit l of the chunk (and l + 32) from
// shared memory and dots it with each masked token's x; lanes reduce with shuffles at the end of
// a row. With row blocking (Geom::RB = 2: several tokens, many
// rows) a chunk holds two such sets of rows, and a lane decodes its unit in both before it reads
// each token's x once for the two; every row still sums its units in the same lanes and order, so
// its bits do not depend on RB or on the other tokens. x is either converted once per CTA into
// shared memory (matmul) or read where a previous kernel left it, already in the policy's layout
// (moe).
//
// Launch: kThreads threads, dynamic shared memory = tables | x | kWarps * S stages (+16 bytes of
// slack for the 2-aligned word loads), grid = min(tiles / warps, occupancy * SMs) CTAs. The tile
// count may be read on the device (a moe call knows its expert groups only there): CTAs beyond it
// return at once.
#pragma once
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "cuda/units.cuh"

namespace ft::cuda {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

// Row blocking (Geom::RB): with several tokens each token's x is the same for every row, so a
// lane may decode its unit in RB = 2 rows and read each token's x once for both. It halves the
// tiles, and with them the warps a small matrix keeps busy, and costs registers (IQ3_S: 48 ->
// 64-80), so it pays only with enough rows (blocked_rows_pay); q8 policies only.
template <class Pol, int NT> constexpr int max_row_blocks() { return Pol::kQ8 && NT > 1 ? 2 : 1; }

// ---- cp.async (sm_80+) -------------------------------------------------------------------------------
#if !defined(FT_CUDA_EMULATE)
__device__ __forceinline__ void cp_async16(void* smem, uintptr_t gmem, int src_bytes) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// 16 bytes at the 16-aligned address p into dst (16-aligned shared memory); bytes outside
// [lo, hi) are not read (they become zero).
__device__ __forceinline__ void copy_piece(uint8_t* dst, uintptr_t p, uintptr_t lo, uintptr_t hi) {
    if (p >= lo && p + 16 <= hi) {
        cp_async16(dst, p, 16);
    } else if (p >= lo) {
        cp_async16(dst, p, int(hi - p));  // tail piece: 1..15 valid bytes, rest zero-filled
    } else {                              // head piece of a tensor that is not 16-aligned
#pragma unroll 1
        for (int i = 0; i < 16; ++i) {
            const uintptr_t b = p + i;
            dst[i] = (b >= lo && b < hi) ? *reinterpret_cast<const uint8_t*>(b) : uint8_t(0);
        }
    }
}

// ---- x into shared memory ------------------------------------------------------------------------------
// Block-cooperative. `load(v, g, j)` returns values 32g + 4j .. +3 of vector v as a float4.
// Eight consecutive lanes handle one 32-value group.

template <class Load>
__device__ void prep_x_q8(const Load& load, int nvec, int ng, uint8_t* q, float2* ds) {
    constexpr int B = 4;  // items a thread loads before it converts any: their latencies overlap
    const int total = nvec * ng * 8;
    for (int base = 0; base < total; base += B * blockDim.x) {  // uniform trip count: shuffles below
        float4 xs[B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int i = base + b * blockDim.x + threadIdx.x;
            const int gi = i >> 3, v = gi / ng;
            xs[b] = i < total ? load(v, gi - v * ng, i & 7) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (base + b * blockDim.x >= total) break;  // uniform: the rest of the block has no items
            const int i = base + b * blockDim.x + threadIdx.x;
            const bool ok = i < total;
            const int gi = i >> 3, j = i & 7;
            const int v = ok ? gi / ng : 0, g = ok ? gi - v * ng : 0;
            const float4 x = xs[b];
            float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            // IEEE division and reciprocal (not the fast-math ones): the tests rebuild this rounding.
            const float d = __fdiv_rn(amax, 127.0f);
            const float id = d > 0.f ? __frcp_rn(d) : 0.f;
            const int q0 = __float2int_rn(__fmul_rn(x.x, id)), q1 = __float2int_rn(__fmul_rn(x.y, id));
            const int q2 = __float2int_rn(__fmul_rn(x.z, id)), q3 = __float2int_rn(__fmul_rn(x.w, id));
            int s = q0 + q1 + q2 + q3;
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (ok) {
                const uint32_t packed = uint32_t(q0 & 0xFF) | (uint32_t(q1 & 0xFF) << 8) |
                                        (uint32_t(q2 & 0xFF) << 16) | (uint32_t(q3 & 0xFF) << 24);
                const int half = (j >> 2) ^ ((g >> 2) & 1);
                *reinterpret_cast<uint32_t*>(q + (size_t(v) * ng + g) * 32 + 16 * half + 4 * (j & 3)) = packed;
                if (j == 0) ds[size_t(v) * ng + g] = make_float2(d, d * float(s));
            }
        }
    }
}

template <class Load>
__device__ void prep_x_f32(const Load& load, int nvec, int ng, float* xf) {
    const int total = nvec * ng * 8;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int gi = i >> 3, j = i & 7;
        const int v = gi / ng, g = gi - v * ng;
        *reinterpret_cast<float4*>(xf + (size_t(v) * ng + g) * 36 + 4 * j) = load(v, g, j);
    }
}

template <class Pol, class Load>
__device__ void prep_x(const Load& load, int nvec, int ng, uint8_t* dst) {
    if constexpr (Pol::kQ8)
        prep_x_q8(load, nvec, ng, dst, reinterpret_cast<float2*>(dst + size_t(nvec) * ng * 32));
    else
        prep_x_f32(load, nvec, ng, reinterpret_cast<float*>(dst));
}

template <class Pol> inline size_t x_bytes(int nvec, int ng) {
    return size_t(nvec) * ng * (Pol::kQ8 ? 40 : 144);
}

// f32 rows in global memory (x [nvec, ldx]).
struct GlobalX {
    const float* x;
    int64_t ldx;
    bool aligned;  // x and ldx allow float4 loads
    __device__ float4 operator()(int v, int g, int j) const {
        const float* p = x + v * ldx + 32 * g + 4 * j;
        if (aligned) return __ldg(reinterpret_cast<const float4*>(p));
        return make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3));
    }
};

// n / d for a divisor fixed at launch (1 <= d < 2^31, 0 <= n < 2^31): a multiply-high, an add and a
// shift instead of a division's ~20 instructions; maps split tile indices with it on every chunk.
struct FastDiv {
    uint32_t d = 1, m = 1, s = 0;
    FastDiv() = default;
    explicit FastDiv(uint32_t div) : d(div) {
        while ((uint32_t(1) << s) < d) ++s;
        m = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << s) - d) / d + 1);
    }
    __device__ __forceinline__ int div(int n) const {
        return int((__umulhi(uint32_t(n), m) + uint32_t(n)) >> s);
    }
};

// ---- the rows kernel -----------------------------------------------------------------------------------

// One row of a tile, as a map describes it.
struct Seg {
    const uint8_t* ptr;  // first block of the row
    uintptr_t lo, hi;    // bytes that may be read around it (the weight tensor or pool)
    int xvec;            // x vector of the tile's first masked token
};

// Chunking of one launch, computed on the host (make_geom).
struct Geom {
    int nkb;           // kernel blocks per row
    int bpc;           // kernel blocks per chunk (per segment)
    int cpr;           // chunks per row
    int G;             // rows (segments) per chunk
    int P;             // lanes per segment: a power of two, G * P <= 32
    int RB;            // row blocks a chunk holds: rows G*RB, a lane's unit in RB of them
    int seg_stride;    // bytes of shared memory per segment (multiple of 16)
    int stage_stride;  // G * RB * seg_stride
    int grid_copies;   // copies of the policy's lookup table in shared memory (power of two)
    int x_off, stage_off;  // shared memory offsets (tables at 0)
};

// Position of a chunk in a warp's sequence: tile, first row of the chunk, chunk within the row.
struct ChunkPos {
    int tile, ri0, ck;
    // The next chunk (rows advance after cpr chunks, tiles after ceil(R / (G * RB)) row blocks).
    __device__ __forceinline__ void next(const Geom& geo, int R, int W) {
        if (++ck == geo.cpr) {
            ck = 0;
            ri0 += geo.G * geo.RB;
            if (ri0 >= R) {
                ri0 = 0;
                tile += W;
            }
        }
    }
};

// Map interface (device): n_tiles(), rows_per_tile(), tile_mask(tile) (tokens of the tile: bit t
// -> acc[t]; at most NT bits), kCompactX (false: token t's x is vector xvec + t; true: the masked
// tokens' vectors are consecutive from xvec, in bit order); row(tile, i, Seg&) -> false if the row
// contributes nothing; store(tile, i, acc) (acc[t] for t in the mask); prep<Pol>(x shared memory);
// xview(smem). U = 2: a chunk may hold 64 units of a row, two a lane (make_geom's two_units); a
// kernel of its own, so that the others compile as they did without it (a loop over a lane's
// units took the 8-token expert kernels from 57 to 80 registers, 78 to 104 with two row blocks).
template <class Pol, int NT, int RB, class Map, int U>
__global__ void __launch_bounds__(kThreads)
rows_kernel(const Map map, const Geom geo, const Grids grids) {
    FT_DYNAMIC_SMEM(smem);
    constexpr int S = Pol::kStages, kbB = Pol::kKbBytes, subs = Pol::kSubs;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t* const ring = smem + geo.stage_off + size_t(warp) * S * geo.stage_stride;

    const int gw = blockIdx.x * kWarps + warp, W = gridDim.x * kWarps;
    const int n_tiles = map.n_tiles(), R = map.rows_per_tile();
    if (int(blockIdx.x) * kWarps >= n_tiles) return;  // the whole CTA: no barrier is left waiting
    const int GR = geo.G * RB;                          // rows a chunk holds
    const int cpt = (R + GR - 1) / GR * geo.cpr;       // chunks per tile
    const int n_my = gw < n_tiles ? (n_tiles - 1 - gw) / W + 1 : 0;
    const int n_chunks = n_my * cpt;
    const int np_max = geo.seg_stride >> 4;

    // Copy chunk `p` into stage `slot`: lane l takes 16-byte pieces l, l+32, ... of its segments.
    auto issue = [&](const ChunkPos& p, int slot) {
        uint8_t* buf = ring + slot * geo.stage_stride;
        const int b0 = p.ck * geo.bpc, n = min(geo.bpc, geo.nkb - b0) * kbB;
        if constexpr (U == 2) {
            if (GR == 1) {  // one row a chunk: its segment found once, not once a piece
                Seg sg;
                if (!map.row(p.tile, p.ri0, sg)) return;
                const uintptr_t a = reinterpret_cast<uintptr_t>(sg.ptr) + uintptr_t(b0) * kbB;
                const int np = int(((a & 15) + n + 15) >> 4);
                for (int pc = lane; pc < np; pc += 32)
                    copy_piece(buf + 16 * pc, (a & ~uintptr_t(15)) + 16 * pc, sg.lo, sg.hi);
                return;
            }
        }
        for (int l = lane; l < GR * np_max; l += 32) {
            const int j = GR == 1 ? 0 : l / np_max, pc = l - j * np_max;
            Seg sg;
            if (p.ri0 + j >= R || !map.row(p.tile, p.ri0 + j, sg)) continue;
            const uintptr_t a = reinterpret_cast<uintptr_t>(sg.ptr) + uintptr_t(b0) * kbB;
            if (pc >= int(((a & 15) + n + 15) >> 4)) continue;
            copy_piece(buf + j * geo.seg_stride + 16 * pc, (a & ~uintptr_t(15)) + 16 * pc, sg.lo, sg.hi);
        }
    };

    // Start the weight stream before the prologue: it does not depend on x.
    ChunkPos ip{gw, 0, 0};  // next chunk to issue
    int islot = 0;
#pragma unroll 1
    for (int c = 0; c < S - 1; ++c) {
        if (c < n_chunks) issue(ip, islot);
        cp_async_commit();
        ip.next(geo, R, W);
        islot = islot + 1 == S ? 0 : islot + 1;
    }
    Pol::load_tables(smem, grids, geo.grid_copies);
    map.template prep<Pol>(smem + geo.x_off);
    __syncthreads();  // the last block-wide barrier: warps run independently from here

    const Pol pol(smem, grids, geo.grid_copies, lane);
    const XView xv = map.xview(smem + geo.x_off);
    // Lane: unit u of segment j of each of the chunk's RB row blocks (rows j, j + G, ...).
    const int j = lane / geo.P, u = lane - j * geo.P;
    float acc[RB][NT];
#pragma unroll
    for (int b = 0; b < RB; ++b)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[b][t] = 0.f;

    ChunkPos cp{gw, 0, 0};  // chunk to compute
    int cslot = 0;
    uint32_t tmask = 0;
    const uint8_t* row_ptr[RB] = {};
    bool have[RB] = {};
    int xvec = 0;
#pragma unroll 1
    for (int c = 0; c < n_chunks; ++c) {
        if (c + S - 1 < n_chunks) issue(ip, islot);
        cp_async_commit();
        ip.next(geo, R, W);
        islot = islot + 1 == S ? 0 : islot + 1;
        cp_async_wait<S - 1>();  // this lane's pieces of chunk c have landed
        __syncwarp();            // ... and every other lane's

        const uint8_t* buf = ring + cslot * geo.stage_stride;
        const int b0 = cp.ck * geo.bpc, nb = min(geo.bpc, geo.nkb - b0);
        if (cp.ck == 0) {  // new rows (and maybe a new tile): what the map says holds for their chunks
            tmask = map.tile_mask(cp.tile);  // the same for the whole warp
#pragma unroll
            for (int b = 0; b < RB; ++b) {
                const int ri = cp.ri0 + j + b * geo.G;
                Seg sg;
                have[b] = j < geo.G && ri < R && map.row(cp.tile, ri, sg);
                row_ptr[b] = have[b] ? sg.ptr : nullptr;
                if (have[b]) xvec = sg.xvec;  // the tile's: the same for each of its rows
            }
        }
        if constexpr (U == 1) {
            if (u < nb * subs && (RB > 1 || have[0])) {  // (one row: skip it where it is missing)
                const uint8_t* blk[RB];
#pragma unroll
                for (int b = 0; b < RB; ++b) {
                    const uintptr_t a = reinterpret_cast<uintptr_t>(row_ptr[b]) + uintptr_t(b0) * kbB;
                    blk[b] = buf + (j + b * geo.G) * geo.seg_stride + (a & 15) + (u / subs) * kbB;
                }
                pol.template dot<NT, RB, Map::kCompactX>(blk, have, u % subs, xv, xvec, tmask,
                                                         b0 * subs + u, acc);
            }
        } else if (RB > 1 || have[0]) {
            // units u and u + 32 of a 64-unit chunk, in the order chunks of 32 would bring them
            // (the body is the branch above's: shared as a lambda, it changed the code of every
            // U = 1 kernel, which is kept instruction for instruction as measured)
#pragma unroll 1
            for (int uu = u; uu < nb * subs; uu += geo.P) {
                const uint8_t* blk[RB];
#pragma unroll
                for (int b = 0; b < RB; ++b) {
                    const uintptr_t a = reinterpret_cast<uintptr_t>(row_ptr[b]) + uintptr_t(b0) * kbB;
                    blk[b] = buf + (j + b * geo.G) * geo.seg_stride + (a & 15) + (uu / subs) * kbB;
                }
                pol.template dot<NT, RB, Map::kCompactX>(blk, have, uu % subs, xv, xvec, tmask,
                                                         b0 * subs + uu, acc);
            }
        }
        if (cp.ck == geo.cpr - 1) {  // end of the rows: reduce each over its P lanes
#pragma unroll
            for (int b = 0; b < RB; ++b) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (!((tmask >> t) & 1)) continue;
                    float v = acc[b][t];
                    for (int o = geo.P >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    acc[b][t] = v;
                }
                if (have[b] && u == 0) map.store(cp.tile, cp.ri0 + j + b * geo.G, acc[b]);
#pragma unroll
                for (int t = 0; t < NT; ++t) acc[b][t] = 0.f;
            }
        }
        cp.next(geo, R, W);
        cslot = cslot + 1 == S ? 0 : cslot + 1;
        __syncwarp();  // everyone is done with this stage before it is refilled
    }
    cp_async_wait<0>();
}

// ---- host side -----------------------------------------------------------------------------------------

// Copies of a policy's lookup table (IQ3_S grid) in shared memory: lane l reads copy l % copies,
// which spreads 32 random lookups over more banks (expected worst bank ~3.5-way with 1 copy,
// 2-way with 16). Default 1 (measured fastest on the H200, see matvec.cu);
// FTPATCH_IQ_GRID_COPIES (1, 2, 4, 8, 16 or 32) overrides, for tuning.
int grid_copies();

// Whether 64 units of the policy's type fit a chunk of 1152 bytes: IQ3_S (880), Q4_K (1152),
// IQ4_XS, Q2_K, Q3_K, the IQ2 types, Q4_0; wider blocks (Q5_K 1408, Q6_K 1680, Q8_0 2176, f16
// 4096) keep chunks of 32 units, and no U = 2 kernel is built for them.
template <class Pol> constexpr bool two_units_fit() { return 64 / Pol::kSubs * Pol::kKbBytes <= 1152; }

// Whether a launch of one token over `rows` rows should take chunks of 64 units (make_geom's
// `two_units`): where every warp slot of the device still streams four rows or more. With one
// token a lane's unit is a short dot, so a chunk's fixed work weighs; on the H200 (IQ3_S,
// docs/BENCHMARKS.md, rows engine) the output head went from 207 to 175 us and 2048x8192 from
// 11.8 to 11.1, but 4096x2048 (a row a warp) from 8.8 to 9.4, and with several tokens (two row
// blocks: twice the stage memory) 2048x8192 at T = 4 from 19.1 to 24.3.
inline bool two_units_pay(int64_t rows) { return rows >= int64_t(4) * kWarps * device_info().sms; }

// Chunking for rows of nkb kernel blocks and the shared memory layout for `x_bytes` of x.
// two_units: chunks of 64 units (two a lane) where the rows are that long and the blocks small.
template <class Pol> Geom make_geom(int64_t nkb, size_t x_bytes, int RB = 1, bool two_units = false) {
    constexpr int kbB = Pol::kKbBytes, subs = Pol::kSubs;
    Geom g{};
    g.nkb = int(nkb);
    g.RB = RB;
    const int64_t upr = nkb * subs;  // units per row
    if (upr >= 32) {
        g.G = 1;
        g.P = 32;
        // two units a lane: a chunk's fixed work (finding the row, the copies' set-up, the
        // waits, the next position) is paid once for both
        const bool two = two_units && upr >= 64 && two_units_fit<Pol>();
        g.bpc = (two ? 64 : 32) / subs;
        g.cpr = int(cdiv(nkb, g.bpc));
    } else {
        g.P = ceil_pow2(int(upr));
        g.G = 32 / g.P;
        g.bpc = int(nkb);
        g.cpr = 1;
    }
    g.seg_stride = int(16 * cdiv(15 + int64_t(g.bpc) * kbB, 16));
    g.stage_stride = g.G * RB * g.seg_stride;
    g.grid_copies = Pol::kTableBytes ? grid_copies() : 1;
    g.x_off = int(cdiv(int64_t(Pol::table_bytes(g.grid_copies)), 16) * 16);
    g.stage_off = int(g.x_off + cdiv(int64_t(x_bytes), 16) * 16);
    return g;
}

template <class Pol> size_t smem_bytes(const Geom& g) {
    return size_t(g.stage_off) + size_t(kWarps) * Pol::kStages * g.stage_stride + 16;
}

// CTAs per SM for a kernel at a dynamic shared memory size (cached per device and size).
int ctas_per_sm(const void* kernel, size_t smem);

// Whether a launch of `blocked_tiles` tiles of two row blocks each is worth blocking: when they
// still give every warp slot of the device two tiles. On the H200 (IQ3_S, docs/BENCHMARKS.md,
// rows engine) blocking took 2048x8192 from 21.5 to 19.1 us at T = 4 and the output head from 336
// to 312, but 4096x2048 from 17.5 to 18.2 and 2048x512 from 9.0 to 10.8.
// (row_blocking(), api.h, overrides: 1 never, 2 always.)
inline bool blocked_rows_pay(int64_t blocked_tiles) {
    const int mode = row_blocking();
    if (mode) return mode == 2;
    return blocked_tiles >= int64_t(2) * kWarps * device_info().sms;
}

// The fewest chunks a warp streams when there is enough work (1: a warp per tile, as many CTAs
// as occupancy allows). Every CTA first converts x into shared memory and loads the lookup
// table; on decode's small matrices (an expert's 512 rows of 8 IQ3_S blocks: 2 chunks a row)
// that prologue outweighs the rows, so fewer CTAs, each streaming more, can finish sooner.
// FTPATCH_ROWS_MIN_CHUNKS overrides the default; set_rows_min_chunks for same-process A/B
// (both declared in api.h, defined in matvec.cu beside grid_copies).

// Enqueue rows_kernel<Pol, NT, RB, Map, U> over `n_tiles` tiles of `rows_per_tile` rows (per
// blockIdx.y of `grid_y`); geo.RB must be RB, and chunks of 64 units need U = 2.
template <class Pol, int NT, int RB, class Map, int U = 1>
void launch_rows(const Map& map, const Geom& geo, int64_t n_tiles, int64_t rows_per_tile, int grid_y,
                 cudaStream_t stream) {
    const Grids& grids = device_grids(UsesGrids<Pol::kType>::value);
    if (n_tiles <= 0 || grid_y <= 0) return;
    require(geo.RB == RB, "launch_rows: geometry made for another row blocking");
    require(U == 2 || geo.G > 1 || geo.bpc * Pol::kSubs <= 32, "launch_rows: chunks of 64 units need U = 2");
    auto kernel = rows_kernel<Pol, NT, RB, Map, U>;
    const size_t smem = smem_bytes<Pol>(geo);
    const DeviceInfo& dev = device_info();
    require(smem <= size_t(dev.smem_optin),
            "rows kernel needs " + std::to_string(smem) + " bytes of shared memory, the device allows " +
                std::to_string(dev.smem_optin));
    if (smem > 48 * 1024)
        FT_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int per_sm = ctas_per_sm(reinterpret_cast<const void*>(kernel), smem);
    const int64_t chunks_per_tile = cdiv(rows_per_tile, int64_t(geo.G) * RB) * geo.cpr;
    const int64_t tiles_per_warp = cdiv(rows_min_chunks(), chunks_per_tile);
    const int64_t one_each = cdiv(n_tiles, kWarps);   // a tile a warp
    int64_t want = cdiv(n_tiles, kWarps * (tiles_per_warp > 1 ? tiles_per_warp : 1));
    // ... but never fewer CTAs than SMs while there are tiles for them (the shared expert's 512
    // rows ran 5.0 us at one tile a warp, 6.7 us at half the CTAs)
    const int64_t floor = one_each < dev.sms ? one_each : dev.sms;
    want = want > floor ? want : floor;
    const int64_t cap = int64_t(per_sm) * dev.sms;
    const dim3 grid(unsigned(want < cap ? want : cap), unsigned(grid_y));
    FT_LAUNCH(kernel, grid, kThreads, smem, stream, map, geo, grids);
    check_launch("rows_kernel");
}

// Largest number of x vectors (<= want) whose shared memory fits next to the stages.
template <class Pol> int fit_vectors(int64_t nkb, int ng, int want, int RB) {
    const size_t limit = size_t(device_info().smem_optin);
    for (int n = want; n > 1; --n)
        if (smem_bytes<Pol>(make_geom<Pol>(nkb, x_bytes<Pol>(n, ng), RB)) <= limit) return n;
    return 1;
}

// Block starts must be aligned as the type's loads assume: the tensor base and every stride.
template <class Pol> void check_alignment(const void* base, int64_t stride, const char* what) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(base);
    require(a % Pol::kAlign == 0 && stride % Pol::kAlign == 0,
            std::string(what) + ": block rows must start at " + std::to_string(Pol::kAlign) +
                "-byte aligned addresses for this type (base " + std::to_string(a % 16) +
                " mod 16, stride " + std::to_string(stride) + ")");
}

}  // namespace ft::cuda
