// pybind11 definitions of native._cuda: the whole CUDA API in one place. Kernels live in
// csrc/cuda/<op>.cu behind the torch-free entry points of csrc/cuda/api.h; these wrappers only
// convert arguments and release the GIL.
//
// Conventions: those of native._cpu (bindings_cpu.cpp), with device memory instead of host memory:
//   * Pointers are Python ints (tensor.data_ptr()) of device memory on the *current* CUDA device;
//     sizes are ints; type ids are ggml ids.
//   * Every kernel entry point ends with `stream: int`, a cudaStream_t handle
//     (torch.cuda.current_stream().cuda_stream). The call only enqueues work on that stream and
//     returns: the caller keeps every buffer alive until the stream has run it. No host sync, no
//     allocation (moe_ffn excepted: stream-ordered cudaMallocAsync), so everything is capturable
//     in a CUDA graph.
//   * Bad arguments raise ValueError before anything is enqueued; launch failures RuntimeError.
//     Faults inside a kernel surface at the next synchronisation, as CUDA errors always do.
//
// Kernel entry points (outputs fully overwritten):
//   dequantize(type_id, src, n_rows, n_cols, src_row_stride, dst, dst_dtype, stream)
//       as native._cpu: dst contiguous [n_rows, n_cols] of dst_dtype 0 (F32), 1 (F16), 30 (BF16);
//       F32 bit-exact with gguf-py, F16/BF16 that rounded to nearest even.
//   rows_to_f16(x, n_rows, n_cols, ldx, out, row_scale, stream)
//       out [n_rows, n_cols] f16 = x f32 rows (stride ldx floats) times 2^-k per row, k >= 0 the
//       least that keeps the row in f16's range; row_scale [n_rows] f32 = 2^k (prefill GEMMs).
//   matmul(type_id, w, n_out, n_in, w_row_stride, x, n_tok, y, stream)
//       as native._cpu: y [n_tok, n_out] = x [n_tok, n_in] @ W^T. Decode kernels: 1..8 tokens per
//       launch (more tokens re-read W per 8; use dequantize + a GEMM for prefill).
//       Accumulation per type: matmul_accum() (see below).
//   moe_ffn(x, n_tok, hidden, ff, n_experts, ids, weights, top_k, gate_type, gate,
//           gate_expert_stride, up_type, up, up_expert_stride, down_type, down,
//           down_expert_stride, y, stream)
//       as native._cpu, over full banks; ids outside [0, n_experts) contribute nothing (the CPU
//       raises for ids >= E; a kernel cannot). Scratch from cudaMallocAsync on `stream`.
//   moe_ffn_pool(x, n_tok, hidden, ff, ids, weights, top_k, slot_of_expert, n_experts, n_slots,
//                gate_type, gate, gate_slot_bytes, up_type, up, up_slot_bytes, down_type, down,
//                down_slot_bytes, y, skipped, scratch, scratch_bytes, stream, accumulate=False)
//       the decode path over an expert slot pool, routing resolved on the device:
//       y [T, H] (+)= sum_k weights[t,k] * down_s(silu(gate_s x_t) * up_s x_t), s = slot_of_expert[ids[t,k]]
//       (slot_of_expert = 0: s = ids[t,k]); pairs with an id outside [0, n_experts) or a slot
//       outside [0, n_slots) are skipped: skipped [T, K] int32 (0 = no output) gets 1 for them.
//       x f32 [T, H], ids int32 [T, K], weights f32 [T, K], y f32 [T, H], all contiguous; pools:
//       slot s of a projection at <proj> + s * <proj>_slot_bytes, rows contiguous ([F, H] for
//       gate/up, [H, F] for down). T <= 8, top_k <= 16. scratch: >= moe_scratch_bytes(T, K, F, H)
//       bytes, 16-byte aligned, caller-owned, not read before it is written.
//   moe_scratch_bytes(n_tok, top_k, ff, hidden) -> int
//   residual_rms_norm, conv_silu_steps, delta_rule_steps, route_topk, attention_steps, swiglu: the decode-step
//       kernels of csrc/cuda/step.cu (arguments as in csrc/cuda/api.h; optional pointers 0). The
//       sequence kernels take their states' addresses as lists, or table (a device int64 address)
//       with at / at_k, at_v (each sequence's index there) and empty lists: api.h's SeqTable.
//   softmax_tile: one tile's online-softmax update of a prompt chunk's attention
//       (csrc/cuda/softmax_tile.cu; pos 0: no causal limit).
// Protocol constants (offload_bindings.h, export_protocol): MAX_SELECTIONS, STATS_COLUMNS,
//   SCORE_ONE, SCORE_STEPS, OUTPUT_DTYPES -- module attributes, the same in both extensions.
// Table and control functions (hold the GIL, cheap):
//   set_tables(dict name -> buffer)   IQ grids from loaders.quants.iq_tables(); uploaded now to the
//       current device (other devices at first use: do that outside capture). Needed before any
//       kernel call.
//   tables_ready() -> bool
//   block_sizes() -> {name: (block_elems, block_bytes)}   ggml's sizes, from quants.h
//   dequantize_types(), matmul_types(), moe_ffn_types() -> [names]   every type of the list
//   float_matmul(type_id, w, n_out, n_in, w_row_stride, x, n_tok, y, stream)
//       decode's product with an F32/F16/BF16 weight, 1..8 rows of x, each row's bits
//       independent of n_tok (api.h)
//   matmul_accum() -> {name: "q8" | "f32"}   "q8": x rounded to int8 per 32 values
//       (d = amax/127, q = rint(x/d)); y exact for that x up to float32 sums. "f32": float x, FMA.
//       moe_ffn uses the same rule per projection (the down input h is rounded the same way).
//   device_limits() -> {"sms": int, "smem_optin": int}   of the current device
//   built_archs() -> [str]   what the binary holds: "sm_XY" machine code, "compute_XY" PTX
//   built_with() -> str      the nvcc version that compiled it
#include <pybind11/pybind11.h>

#include "offload_bindings.h"
#include "py_errors.h"
#include "cuda/offload_api.h"
#include <pybind11/stl.h>
#include <utility>

#include "cuda/api.h"
#include "quants.h"

namespace py = pybind11;
using namespace ft;

namespace {

template <class T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// A step kernel's sequences: their states' addresses, or (table != 0) a device table of addresses
// and each sequence's place in it (api.h, SeqTable). `at` must outlive the call.
struct Sequences {
    cuda::SeqTable table;
    int64_t n = 0;
    Sequences(size_t n_ptrs, uintptr_t t, const std::vector<int32_t>& at, const char* what) {
        if (t ? n_ptrs != 0 : !at.empty())
            throw std::invalid_argument(std::string(what) + ": give the states' addresses, or a table "
                                        "and each state's place in it, not both");
        for (int32_t a : at)
            if (a < 0) throw std::invalid_argument(std::string(what) + ": a negative place in the table");
        table = {ptr<const int64_t>(t), t ? at.data() : nullptr};
        n = int64_t(t ? at.size() : n_ptrs);
    }
};

std::vector<uint8_t> buffer_bytes(const py::handle& obj) {
    const py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
    const auto* p = static_cast<const uint8_t*>(info.ptr);
    return std::vector<uint8_t>(p, p + size_t(info.size * info.itemsize));
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "ftpatch CUDA kernels on raw ggml blocks (see bindings_cuda.cpp for the contract)";
    ft::register_native_error();
    ft::export_protocol(m);
    auto release = py::call_guard<py::gil_scoped_release>();

    m.def("dequantize",
          [](int type_id, uintptr_t src, int64_t n_rows, int64_t n_cols, int64_t src_row_stride,
             uintptr_t dst, int dst_dtype, uintptr_t stream) {
              cuda::dequantize(type_id, ptr<const void>(src), n_rows, n_cols, src_row_stride,
                               ptr<void>(dst), dst_dtype, stream);
          },
          py::arg("type_id"), py::arg("src"), py::arg("n_rows"), py::arg("n_cols"),
          py::arg("src_row_stride"), py::arg("dst"), py::arg("dst_dtype"), py::arg("stream") = 0,
          release);
    m.def("rows_to_f16",
          [](uintptr_t x, int64_t n_rows, int64_t n_cols, int64_t ldx, uintptr_t out,
             uintptr_t row_scale, uintptr_t stream) {
              cuda::rows_to_f16(ptr<const float>(x), n_rows, n_cols, ldx, ptr<void>(out),
                                ptr<float>(row_scale), stream);
          },
          py::arg("x"), py::arg("n_rows"), py::arg("n_cols"), py::arg("ldx"), py::arg("out"),
          py::arg("row_scale"), py::arg("stream") = 0, release);
    // matmul (quantized weights) and float_matmul (F32/F16/BF16 rows): one signature
    using RowsProduct = void (*)(int, const void*, int64_t, int64_t, int64_t, const float*,
                                 int64_t, float*, uintptr_t);
    for (auto [name, product] : {std::pair<const char*, RowsProduct>{"matmul", cuda::matmul},
                                 {"float_matmul", cuda::float_matmul}})
        m.def(name,
              [product](int type_id, uintptr_t w, int64_t n_out, int64_t n_in,
                        int64_t w_row_stride, uintptr_t x, int64_t n_tok, uintptr_t y,
                        uintptr_t stream) {
                  product(type_id, ptr<const void>(w), n_out, n_in, w_row_stride,
                          ptr<const float>(x), n_tok, ptr<float>(y), stream);
              },
              py::arg("type_id"), py::arg("w"), py::arg("n_out"), py::arg("n_in"),
              py::arg("w_row_stride"), py::arg("x"), py::arg("n_tok"), py::arg("y"),
              py::arg("stream") = 0, release);
    m.def("moe_ffn",
          [](uintptr_t x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             uintptr_t ids, uintptr_t weights, int64_t top_k, int gate_type, uintptr_t gate,
             int64_t gate_stride, int up_type, uintptr_t up, int64_t up_stride, int down_type,
             uintptr_t down, int64_t down_stride, uintptr_t y, uintptr_t stream) {
              cuda::moe_ffn(ptr<const float>(x), n_tok, hidden, ff, n_experts,
                            ptr<const int32_t>(ids), ptr<const float>(weights), top_k,
                            {gate_type, ptr<const void>(gate), gate_stride},
                            {up_type, ptr<const void>(up), up_stride},
                            {down_type, ptr<const void>(down), down_stride}, ptr<float>(y), stream);
          },
          py::arg("x"), py::arg("n_tok"), py::arg("hidden"), py::arg("ff"), py::arg("n_experts"),
          py::arg("ids"), py::arg("weights"), py::arg("top_k"), py::arg("gate_type"),
          py::arg("gate"), py::arg("gate_expert_stride"), py::arg("up_type"), py::arg("up"),
          py::arg("up_expert_stride"), py::arg("down_type"), py::arg("down"),
          py::arg("down_expert_stride"), py::arg("y"), py::arg("stream") = 0, release);
    m.def("moe_ffn_pool",
          [](uintptr_t x, int64_t n_tok, int64_t hidden, int64_t ff, uintptr_t ids,
             uintptr_t weights, int64_t top_k, uintptr_t slot_of_expert, int64_t n_experts,
             int64_t n_slots, int gate_type, uintptr_t gate, int64_t gate_slot_bytes, int up_type,
             uintptr_t up, int64_t up_slot_bytes, int down_type, uintptr_t down,
             int64_t down_slot_bytes, uintptr_t y, uintptr_t skipped, uintptr_t scratch,
             int64_t scratch_bytes, uintptr_t stream, bool accumulate) {
              cuda::moe_ffn_pool(ptr<const float>(x), n_tok, hidden, ff, ptr<const int32_t>(ids),
                                 ptr<const float>(weights), top_k, ptr<const int32_t>(slot_of_expert),
                                 n_experts, n_slots, {gate_type, ptr<const void>(gate), gate_slot_bytes},
                                 {up_type, ptr<const void>(up), up_slot_bytes},
                                 {down_type, ptr<const void>(down), down_slot_bytes}, ptr<float>(y),
                                 accumulate, ptr<int32_t>(skipped), ptr<void>(scratch),
                                 scratch_bytes, stream);
          },
          py::arg("x"), py::arg("n_tok"), py::arg("hidden"), py::arg("ff"), py::arg("ids"),
          py::arg("weights"), py::arg("top_k"), py::arg("slot_of_expert"), py::arg("n_experts"),
          py::arg("n_slots"), py::arg("gate_type"), py::arg("gate"), py::arg("gate_slot_bytes"),
          py::arg("up_type"), py::arg("up"), py::arg("up_slot_bytes"), py::arg("down_type"),
          py::arg("down"), py::arg("down_slot_bytes"), py::arg("y"), py::arg("skipped"),
          py::arg("scratch"), py::arg("scratch_bytes"), py::arg("stream") = 0,
          py::arg("accumulate") = false, release);
    m.def("moe_scratch_bytes", &cuda::moe_scratch_bytes, py::arg("n_tok"), py::arg("top_k"),
          py::arg("ff"), py::arg("hidden"));

    // decode-step kernels (csrc/cuda/step.cu, documented in csrc/cuda/api.h)
    m.def("residual_rms_norm",
          [](uintptr_t x, int64_t rows, int64_t n, uintptr_t a, int64_t lda, uintptr_t b,
             int64_t ldb, uintptr_t s, int64_t lds, uintptr_t w, float eps, uintptr_t out,
             uintptr_t stream) {
              cuda::residual_rms_norm(ptr<float>(x), rows, n, ptr<const float>(a), lda,
                                      ptr<const float>(b), ldb, ptr<const float>(s), lds,
                                      ptr<const float>(w), eps, ptr<float>(out), stream);
          },
          py::arg("x"), py::arg("rows"), py::arg("n"), py::arg("a"), py::arg("lda"), py::arg("b"),
          py::arg("ldb"), py::arg("s"), py::arg("lds"), py::arg("w"), py::arg("eps"),
          py::arg("out"), py::arg("stream") = 0, release);
    m.def("conv_silu_steps",
          [](uintptr_t x, int64_t ldx, const std::vector<uintptr_t>& states, uintptr_t w,
             int64_t channels, int64_t kc, int64_t n_tok, uintptr_t y, uintptr_t keep,
             uintptr_t table, const std::vector<int32_t>& at, uintptr_t stream) {
              std::vector<float*> st;
              for (uintptr_t a : states) st.push_back(ptr<float>(a));
              const Sequences seqs(st.size(), table, at, "conv_silu_steps");
              cuda::conv_silu_steps(ptr<const float>(x), ldx, st.data(), seqs.table, seqs.n,
                                    ptr<const float>(w), channels, kc, n_tok, ptr<float>(y),
                                    ptr<float>(keep), stream);
          },
          py::arg("x"), py::arg("ldx"), py::arg("states"), py::arg("w"), py::arg("channels"),
          py::arg("kc"), py::arg("n_tok"), py::arg("y"), py::arg("keep") = 0, py::arg("table") = 0,
          py::arg("at") = std::vector<int32_t>{}, py::arg("stream") = 0, release);
    m.def("delta_rule_steps",
          [](uintptr_t y, int64_t ldy, uintptr_t z, int64_t ldz, uintptr_t beta_raw,
             uintptr_t alpha_raw, int64_t ldg, uintptr_t ssm_a, uintptr_t dt_bias,
             const std::vector<uintptr_t>& states, uintptr_t norm_w, int64_t n_tok, int64_t hk,
             int64_t hv, int64_t dk, int64_t dv, float eps, uintptr_t out, uintptr_t keep,
             uintptr_t table, const std::vector<int32_t>& at, uintptr_t stream) {
              std::vector<float*> st;
              for (uintptr_t a : states) st.push_back(ptr<float>(a));
              const Sequences seqs(st.size(), table, at, "delta_rule_steps");
              cuda::delta_rule_steps(ptr<const float>(y), ldy, ptr<const float>(z), ldz,
                                     ptr<const float>(beta_raw), ptr<const float>(alpha_raw), ldg,
                                     ptr<const float>(ssm_a), ptr<const float>(dt_bias), st.data(),
                                     seqs.table, seqs.n, ptr<const float>(norm_w), n_tok, hk, hv, dk,
                                     dv, eps, ptr<float>(out), ptr<float>(keep), stream);
          },
          py::arg("y"), py::arg("ldy"), py::arg("z"), py::arg("ldz"), py::arg("beta_raw"),
          py::arg("alpha_raw"), py::arg("ldg"), py::arg("ssm_a"), py::arg("dt_bias"),
          py::arg("states"), py::arg("norm_w"), py::arg("n_tok"), py::arg("hk"), py::arg("hv"),
          py::arg("dk"), py::arg("dv"), py::arg("eps"), py::arg("out"), py::arg("keep") = 0,
          py::arg("table") = 0, py::arg("at") = std::vector<int32_t>{}, py::arg("stream") = 0,
          release);
    m.def("route_topk",
          [](uintptr_t logits, int64_t rows, int64_t ld, int64_t n_experts, int64_t top_k,
             float floor, uintptr_t ids, uintptr_t weights, uintptr_t stream) {
              cuda::route_topk(ptr<const float>(logits), rows, ld, n_experts, top_k, floor,
                               ptr<int32_t>(ids), ptr<float>(weights), stream);
          },
          py::arg("logits"), py::arg("rows"), py::arg("ld"), py::arg("n_experts"), py::arg("top_k"),
          py::arg("floor"), py::arg("ids"), py::arg("weights"), py::arg("stream") = 0, release);
    m.def("attention_steps",
          [](uintptr_t qg, int64_t ldq, uintptr_t k, uintptr_t v, int64_t ldkv, uintptr_t q_norm,
             uintptr_t k_norm, float eps, const std::vector<uintptr_t>& pos, int64_t n_rot, float base,
             const std::vector<uintptr_t>& k_caches, const std::vector<uintptr_t>& v_caches,
             int cache_dtype, int64_t n_attn, int64_t hq, int64_t hkv, int64_t d, uintptr_t workspace,
             uintptr_t out, bool write_first, uintptr_t table, const std::vector<int32_t>& at_k,
             const std::vector<int32_t>& at_v, uintptr_t stream) {
              const size_t n = pos.size();
              if (table ? (at_k.size() != n || at_v.size() != n || !k_caches.empty() || !v_caches.empty())
                        : (k_caches.size() != n || v_caches.size() != n || !at_k.empty() || !at_v.empty()))
                  throw std::invalid_argument("attention_steps: one position and one pair of caches "
                                              "(or of table places) a sequence");
              std::vector<const int64_t*> ps;
              std::vector<void*> kc, vc;
              for (size_t i = 0; i < n; ++i) ps.push_back(ptr<const int64_t>(pos[i]));
              for (size_t i = 0; i < k_caches.size(); ++i) {
                  kc.push_back(ptr<void>(k_caches[i]));
                  vc.push_back(ptr<void>(v_caches[i]));
              }
              const cuda::SeqTable kt{ptr<const int64_t>(table), table ? at_k.data() : nullptr};
              const cuda::SeqTable vt{ptr<const int64_t>(table), table ? at_v.data() : nullptr};
              cuda::attention_steps(ptr<const float>(qg), ldq, ptr<const float>(k), ptr<const float>(v),
                                    ldkv, ptr<const float>(q_norm), ptr<const float>(k_norm), eps,
                                    ps.data(), n_rot, base, kc.data(), vc.data(), kt, vt, cache_dtype,
                                    n_attn, int64_t(n), hq, hkv, d, ptr<float>(workspace),
                                    ptr<float>(out), write_first, stream);
          },
          py::arg("qg"), py::arg("ldq"), py::arg("k"), py::arg("v"), py::arg("ldkv"),
          py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("pos"), py::arg("n_rot"),
          py::arg("base"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cache_dtype"),
          py::arg("n_attn"), py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("workspace"),
          py::arg("out"), py::arg("write_first") = false, py::arg("table") = 0,
          py::arg("at_k") = std::vector<int32_t>{}, py::arg("at_v") = std::vector<int32_t>{},
          py::arg("stream") = 0, release);
    m.def("attention_splits", [](int64_t n_attn) { return cuda::attention_splits(n_attn); },
          py::arg("n_attn"));  // a call, not an address: the CPU emulator resolves it lazily
    m.def("swiglu",
          [](uintptr_t gate, uintptr_t up, int64_t ld, int64_t rows, int64_t n, uintptr_t out,
             uintptr_t stream) {
              cuda::swiglu(ptr<const float>(gate), ptr<const float>(up), ld, rows, n, ptr<float>(out),
                           stream);
          },
          py::arg("gate"), py::arg("up"), py::arg("ld"), py::arg("rows"), py::arg("n"),
          py::arg("out"), py::arg("stream") = 0, release);

    m.def("softmax_tile",
          [](uintptr_t s, int64_t rows, int64_t n, int64_t ld, uintptr_t m, uintptr_t l, uintptr_t corr,
             uintptr_t pos, int64_t T, int64_t j0, uintptr_t stream) {
              cuda::softmax_tile(ptr<float>(s), rows, n, ld, ptr<float>(m), ptr<float>(l), ptr<float>(corr),
                                 ptr<const int64_t>(pos), T, j0, stream);
          },
          py::arg("s"), py::arg("rows"), py::arg("n"), py::arg("ld"), py::arg("m"), py::arg("l"),
          py::arg("corr"), py::arg("pos"), py::arg("T"), py::arg("j0"), py::arg("stream") = 0, release);

    m.def("set_tables", [](const py::dict& tables) {
        std::map<std::string, std::vector<uint8_t>> copy;
        for (auto item : tables) copy[py::str(item.first)] = buffer_bytes(item.second);
        cuda::set_tables(copy);
    }, py::arg("tables"));
    m.def("tables_ready", &cuda::tables_ready);
    m.def("built_archs", [] {   // FT_CUDA_ARCHS: set by CMakeLists.txt, comma-separated
        std::vector<std::string> out;
        std::string all = FT_CUDA_ARCHS;
        for (size_t a = 0, b; a < all.size(); a = b + 1) {
            b = all.find(',', a);
            if (b == std::string::npos) b = all.size();
            if (b > a) out.push_back(all.substr(a, b - a));
        }
        return out;
    });
    m.def("built_with", [] { return std::string(FT_CUDA_VERSION); });
    m.def("block_sizes", [] {
        py::dict out;
#define FT_X(NAME, ...) \
    out[#NAME] = py::make_tuple(Traits<QType::NAME>::block_elems, Traits<QType::NAME>::block_bytes);
        FT_QUANT_TYPES(FT_X)
#undef FT_X
        return out;
    });
    m.def("dequantize_types", &cuda::type_names);
    m.def("matmul_types", &cuda::type_names);
    m.def("moe_ffn_types", &cuda::type_names);
    m.def("matmul_accum", [] {
        py::dict out;
#define FT_X(NAME, ...) out[#NAME] = cuda::matmul_accum(int(QType::NAME));
        FT_QUANT_TYPES(FT_X)
#undef FT_X
        return out;
    });
    m.def("device_limits", &cuda::device_limits);
    m.def("rows_min_chunks", &cuda::rows_min_chunks);
    m.def("set_rows_min_chunks", &cuda::set_rows_min_chunks, py::arg("n"));
    m.def("row_blocking", &cuda::row_blocking);
    m.def("set_row_blocking", &cuda::set_row_blocking, py::arg("mode"));

    // ---- offload runtime: decode-step kernels (csrc/cuda/offload.cu; protocol and tables in
    // csrc/offload_exchange.h; Python side native/offload_native.py) ---------------------------------
    //   pin_host(addr, nbytes) / unpin_host(addr)        page-lock + map host memory (sync, GIL held)
    //   offload_step_begin(step, stream)                  step counter += 1 on the device
    //   offload_plan(tables: dict, exchange: dict, layer, ids, w, x, step, fetch_fraction,
    //                guessed, fetch_list, pair_slots, stream)
    //                                                     hits / fetches / CPU misses of one layer
    //   offload_prefetch(tables, layer, guess, n_guess, reserve, step, list, stream)
    //                                                     slots for a layer's guessed experts
    //   offload_fetch(fetch_list, host_bank, pool, expert_bytes, slot_bytes, max_fetch, stream,
    //                 blocks=16)
    //   offload_wait_add(exchange: dict, layer, step, cpu_pending, y, timeout_ns, error_flag, stream)
    //   offload_link_mark(clock, which, stream) / offload_link_hold(clock, which, count, bytes_each,
    //                 stream)                             the emulated link around a copy (count 0: none)
    //   vmm_supported() / vmm_granularity() / vmm_reserve(nbytes) -> addr / vmm_free(addr, nbytes)
    //   vmm_map(addr, nbytes) -> handle / vmm_unmap(addr, nbytes, handle)
    //                                                     elastic pools (csrc/cuda/vmm.cu; sync)
    m.def("vmm_supported", &cuda::vmm_supported);
    m.def("vmm_granularity", &cuda::vmm_granularity);
    m.def("vmm_reserve", &cuda::vmm_reserve, py::arg("nbytes"));
    m.def("vmm_free", &cuda::vmm_free, py::arg("addr"), py::arg("nbytes"));
    m.def("vmm_map", &cuda::vmm_map, py::arg("addr"), py::arg("nbytes"));
    m.def("vmm_unmap", &cuda::vmm_unmap, py::arg("addr"), py::arg("nbytes"), py::arg("handle"));
    m.def("pin_host", [](uintptr_t p, size_t n) { cuda::pin_host(reinterpret_cast<void*>(p), n); },
          py::arg("addr"), py::arg("nbytes"));
    m.def("unpin_host", [](uintptr_t p) { cuda::unpin_host(reinterpret_cast<void*>(p)); },
          py::arg("addr"));
    m.def("offload_step_begin", [](uintptr_t step, uintptr_t stream) {
        cuda::offload_step_begin(reinterpret_cast<int32_t*>(step), stream);
    }, py::arg("step"), py::arg("stream"));
    m.def("offload_plan",
          [](const py::dict& tables, const py::dict& exchange, int layer, uintptr_t ids, uintptr_t w,
             uintptr_t x, uintptr_t step, uintptr_t fetch_fraction, uintptr_t guessed,
             uintptr_t fetch_list, uintptr_t pair_slots, uintptr_t stream) {
              cuda::offload_plan(cache_tables_from(tables), exchange_from(exchange), layer,
                                 reinterpret_cast<const int32_t*>(ids), reinterpret_cast<const float*>(w),
                                 reinterpret_cast<const float*>(x), reinterpret_cast<const int32_t*>(step),
                                 reinterpret_cast<const float*>(fetch_fraction),
                                 reinterpret_cast<const int32_t*>(guessed),
                                 reinterpret_cast<int32_t*>(fetch_list),
                                 reinterpret_cast<int32_t*>(pair_slots), stream);
          },
          py::arg("tables"), py::arg("exchange"), py::arg("layer"), py::arg("ids"), py::arg("w"),
          py::arg("x"), py::arg("step"), py::arg("fetch_fraction"), py::arg("guessed"),
          py::arg("fetch_list"), py::arg("pair_slots"), py::arg("stream"));
    m.def("offload_prefetch",
          [](const py::dict& tables, int layer, uintptr_t guess, int n_guess, int reserve,
             uintptr_t step, uintptr_t list, uintptr_t stream) {
              cuda::offload_prefetch(cache_tables_from(tables), layer,
                                     reinterpret_cast<const int32_t*>(guess), n_guess, reserve,
                                     reinterpret_cast<const int32_t*>(step),
                                     reinterpret_cast<int32_t*>(list), stream);
          },
          py::arg("tables"), py::arg("layer"), py::arg("guess"), py::arg("n_guess"),
          py::arg("reserve"), py::arg("step"), py::arg("list"), py::arg("stream"));
    m.def("offload_fetch",
          [](uintptr_t fetch_list, uintptr_t host_bank, uintptr_t pool, int64_t expert_bytes,
             int64_t slot_bytes, int max_fetch, uintptr_t stream, int blocks) {
              cuda::offload_fetch(reinterpret_cast<const int32_t*>(fetch_list),
                                  reinterpret_cast<const void*>(host_bank),
                                  reinterpret_cast<void*>(pool), expert_bytes, slot_bytes, max_fetch,
                                  blocks, stream);
          },
          py::arg("fetch_list"), py::arg("host_bank"), py::arg("pool"), py::arg("expert_bytes"),
          py::arg("slot_bytes"), py::arg("max_fetch"), py::arg("stream"), py::arg("blocks") = 16);
    m.def("offload_link_mark", [](uintptr_t clock, int which, uintptr_t stream) {
        cuda::offload_link_mark(reinterpret_cast<uint64_t*>(clock), which, stream);
    }, py::arg("clock"), py::arg("which"), py::arg("stream"));
    m.def("offload_link_hold",
          [](uintptr_t clock, int which, uintptr_t count, int64_t bytes_each, uintptr_t stream) {
              cuda::offload_link_hold(reinterpret_cast<uint64_t*>(clock), which,
                                      reinterpret_cast<const int32_t*>(count), bytes_each, stream);
          },
          py::arg("clock"), py::arg("which"), py::arg("count"), py::arg("bytes_each"), py::arg("stream"));
    m.def("offload_wait_add",
          [](const py::dict& exchange, int layer, uintptr_t step, uintptr_t cpu_pending, uintptr_t y,
             int64_t timeout_ns, uintptr_t error_flag, uintptr_t stream) {
              cuda::offload_wait_add(exchange_from(exchange), layer,
                                     reinterpret_cast<const int32_t*>(step),
                                     reinterpret_cast<const int32_t*>(cpu_pending),
                                     reinterpret_cast<float*>(y), timeout_ns,
                                     reinterpret_cast<int32_t*>(error_flag), stream);
          },
          py::arg("exchange"), py::arg("layer"), py::arg("step"), py::arg("cpu_pending"), py::arg("y"),
          py::arg("timeout_ns"), py::arg("error_flag"), py::arg("stream"));
}
