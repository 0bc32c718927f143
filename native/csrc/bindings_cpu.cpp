// pybind11 definitions of native._cpu: the whole CPU API in one place. Each op lives in
// csrc/cpu/<op>.cpp; these wrappers only convert arguments and release the GIL.
//
// Conventions (shared with native._cuda, whose kernel entry points have the SAME signatures):
//   * Pointers are Python ints (tensor.data_ptr()), sizes are ints, type ids are ggml ids.
//   * Every kernel entry point ends with `stream: int`. CPU: must be 0 (native.ops always passes
//     it: 0 for CPU tensors, torch.cuda.current_stream().cuda_stream for CUDA tensors).
//   * All pointers are host memory here (device memory for _cuda). The caller owns every buffer
//     and keeps it alive for the call; nothing is retained after it returns.
//   * Weight rows hold whole kernel blocks: quant types a whole number of ggml blocks, float
//     types (F32/F16/BF16) a multiple of 32 elements. Raw block rows must be 2-byte aligned.
//   * Long calls release the GIL and run on all pool threads (plus the calling thread). Calls
//     from several Python threads are serialized by the pool. Bad arguments raise ValueError
//     before any output is written (moe_ffn: an out-of-range expert id also raises).
//
// Kernel entry points (outputs fully overwritten):
//   dequantize(type_id, src, n_rows, n_cols, src_row_stride, dst, dst_dtype, stream)
//       src: n_rows rows of raw blocks, row r at src + r*src_row_stride (bytes).
//       dst: contiguous [n_rows, n_cols] of dst_dtype: 0 = F32, 1 = F16, 30 = BF16.
//       F32 output is bit-exact with gguf-py; F16/BF16 are that, rounded to nearest even.
//   matmul(type_id, w, n_out, n_in, w_row_stride, x, n_tok, y, stream)
//       W [n_out, n_in] raw blocks (row o at w + o*w_row_stride); x f32 [n_tok, n_in]
//       contiguous; y f32 [n_tok, n_out] contiguous: y = x @ W^T, float32 accumulation.
//   matmul_multi(weights, n_in, x, n_tok, y, ldy, stream)
//       weights: [(type_id, w, n_out, w_row_stride)], each W_j [n_out_j, n_in] as in matmul; x f32
//       [n_tok, n_in] contiguous; y f32 [n_tok, >= sum n_out] with row stride ldy: W_j's outputs
//       in the columns after those of the weights before it. One activation rounding and one
//       pool hand-off for all of them.
//   moe_ffn(x, n_tok, hidden, ff, n_experts, ids, weights, top_k,
//           gate_type, gate, gate_expert_stride, up_type, up, up_expert_stride,
//           down_type, down, down_expert_stride, y, stream)
//       x f32 [T, H]; ids int32 [T, K]; weights f32 [T, K]; y f32 [T, H] (all contiguous).
//       gate/up banks [E, F, H], down bank [E, H, F]: rows contiguous inside an expert, expert e
//       at base + e*expert_stride (bytes), so a fused gate_up [E, 2F, H] is passed as two views
//       (gate = base, up = base + F*row_bytes, both with stride 2F*row_bytes).
//       y[t] = sum_k weights[t,k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,k];
//       ids[t,k] < 0 skips the slot (e.g. experts computed elsewhere); ids >= E raise.
//   residual_rms_norm(x, rows, n, a, lda, b, ldb, s, lds, w, eps, out, stream)
//   route_topk(logits, rows, ld, n_experts, top_k, floor, ids, weights, stream)
//   swiglu(gate, up, ld, rows, n, out, stream)   out f32 [rows, n] = silu(gate) * up (rows at ld)
//   conv_silu_step(x, ldx, conv_state, w, batch, channels, kc, y, stream)
//   conv_silu_seq(x, ldx, conv_state, w, batch, n_tok, channels, kc, y, stream)
//       conv_silu_step over n_tok tokens of each sequence in order (x rows b*n_tok + t, stride
//       ldx; y [batch*n_tok, channels]): a prompt's causal conv + silu, channels over the pool.
//   delta_rule_step(y, ldy, z, ldz, beta_raw, alpha_raw, ldg, ssm_a, dt_bias, S, norm_w, batch,
//                   hk, hv, dk, dv, eps, out, stream)
//       the delta-net token of a decode step (csrc/cpu/step.cpp): the same arguments and results
//       as native._cuda's (csrc/cuda/api.h), on host memory; denormals flushed.
//   delta_rule_seq(y, ldy, z, ldz, beta_raw, alpha_raw, ldg, ssm_a, dt_bias, S, norm_w, batch,
//                  n_tok, hk, hv, dk, dv, eps, out, stream)
//       delta_rule_step over n_tok tokens of each sequence (rows b*n_tok + t), in order: a prompt.
//   attention(q, q_t, q_h, gate, g_t, g_h, k_cache, v_cache, n_attn, pos0, n_tok, hq, hkv, d, out,
//             stream, kv_type=0)
//       causal GQA attention of one sequence with a sigmoid gate (csrc/cpu/cpu.h): query t of
//       head h at q + (t*q_t + h*q_h) floats, position pos0 + t; gate likewise (0: none);
//       caches [n_ctx, hkv, X] contiguous rows of kv_type (0 f32, 1 f16, 2 q8_0, 3 q4_0;
//       native/kv_cache.py; ATTENTION_KV_TYPES = 4 says so), rows < n_attn read; out f32
//       [n_tok, hq*d].
//   gated_attention(qg, ld_qg, k, v, ld_kv, q_norm, k_norm, eps, pos0, n_tok, hq, hkv, d, n_rot,
//                   inv_freq, k_cache, v_cache, n_attn, q_work, out, stream, kv_type=0)
//       the attention mixer between its projections (csrc/cpu/cpu.h): q/k RMS norm + NEOX RoPE,
//       the cache write at rows pos0 + t (caches of kv_type, as attention takes them; packed rows
//       as native/kv_cache.py packs them), then `attention` with the gate; q_work f32 [T, hq*d].
//   repack(type_id, src, nblocks, dst, items=1, src_stride=0, dst_stride=0)
//       the CPU's repacked form of a file type (quants.h FT_CPU_REPACKED_TYPES; raises for a type
//       without one): `items` runs of nblocks blocks, run i at src + i*src_stride, written to
//       dst + i*dst_stride (bytes). Every kernel above takes the form's type id and gives the
//       original's bits.
// Protocol constants (offload_bindings.h, export_protocol): MAX_SELECTIONS, STATS_COLUMNS,
//   SCORE_ONE, SCORE_STEPS, OUTPUT_DTYPES -- module attributes, the same in both extensions.
// Table and control functions (hold the GIL, cheap):
//   set_tables(dict name -> buffer)   IQ grids from loaders.quants.iq_tables() (copied).
//   tables_ready() -> bool
//   block_sizes() -> {name: (block_elems, block_bytes)}   ggml's sizes, from quants.h
//   dequantize_types(), matmul_types(), moe_ffn_types() -> [names]   the file types the kernels
//       run (the repacked forms run too, but are not file types)
//   repacked_type(type_id) -> (id, name, block_elems, block_bytes) | None   a type's CPU form
//   accumulation(name) -> "f32" | "q8"   how the active ISA's matmul/moe_ffn accumulate a type:
//       f32 = exact weights x float activations; q8 = exact weights x activations rounded to
//       int8 per 32 features (native.numerics.q8_round), integer sums per 16 weights, float32
//       scales; q16 = the same with int16 per 32 features (native.numerics.q16_round)
//   quantize_q8(x, n_tok, n, q, d, m16)   the active ISA's activation rounding (raises if it has
//       none): x f32 [T, n] -> q int8 [T, n], d f32 [T, n/32], m16 f32 [T, n/16] = d * sum of q
//       per 16 (what the q8 kernels multiply; tests hold it to q8_round bit for bit)
//   quantize_q16(x, n_tok, n, q, d, s)   the same for the int16 form: q int16 [T, n], d and
//       s = d * sum of q f32 [T, n/32] (held to q16_round bit for bit)
//   set_threads(n) (n <= 0: all cores), threads() -> int
//   hold_threads(on)   while held (counted), idle pool threads spin instead of sleeping: a CPU
//       forward holds them, so its few hundred calls a token start without waking 15 threads
//   set_pin_threads(on), threads_pinned() -> bool   workers pinned one per allowed CPU (the env
//       FTPATCH_PIN_THREADS=1 sets it at start); a running pool is rebuilt
//   iq3s_grid() -> str, set_iq3s_grid(how)   how the avx2 table's IQ3_S reads its grid: "gather"
//       (default on Intel) or "loads" (elsewhere); env FTPATCH_IQ3S_GRID; the same bits either way
//   isa() -> str, available_isas() -> [str], set_isa(name)   ("generic" | "avx2" | "avx512"; the env
//       FTPATCH_CPU_ISA picks the start value, default: the best this CPU runs)
#include <memory>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu/cpu.h"
#include "cpu/decode_loop.h"
#include "cpu/offload_worker.h"
#include "offload_bindings.h"
#include "py_errors.h"

namespace py = pybind11;
using namespace ft;

namespace {

template <class T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

void no_stream(uintptr_t stream) {
    if (stream != 0) throw std::invalid_argument("native._cpu takes stream=0");
}

bool is_repacked(int id) {
#define FT_X(NAME, BE, BB) if (id == int(QType::NAME)) return true;
    FT_CPU_REPACKED_TYPES(FT_X)
#undef FT_X
    return false;
}

// the file types the kernels run (the repacked forms are reached through repacked_type)
std::vector<std::string> type_names() {
    std::vector<std::string> out;
    for (int id = 0; id < cpu::kMaxTypeId; ++id)
        if (cpu::kernels().types[id].dot_row && !is_repacked(id)) out.push_back(cpu::kernels().types[id].name);
    return out;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
    m.doc() = "ftpatch CPU kernels on raw ggml blocks (see bindings_cpu.cpp for the contract)";
    ft::register_native_error();
    ft::export_protocol(m);
    auto release = py::call_guard<py::gil_scoped_release>();

    m.def("dequantize",
          [](int type_id, uintptr_t src, int64_t n_rows, int64_t n_cols, int64_t src_row_stride,
             uintptr_t dst, int dst_dtype, uintptr_t stream) {
              no_stream(stream);
              cpu::dequantize(type_id, ptr<const uint8_t>(src), n_rows, n_cols, src_row_stride,
                              ptr<void>(dst), dst_dtype);
          },
          py::arg("type_id"), py::arg("src"), py::arg("n_rows"), py::arg("n_cols"),
          py::arg("src_row_stride"), py::arg("dst"), py::arg("dst_dtype"), py::arg("stream") = 0,
          release);
    m.def("matmul",
          [](int type_id, uintptr_t w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
             uintptr_t x, int64_t n_tok, uintptr_t y, uintptr_t stream) {
              no_stream(stream);
              cpu::matmul(type_id, ptr<const uint8_t>(w), n_out, n_in, w_row_stride,
                          ptr<const float>(x), n_tok, ptr<float>(y));
          },
          py::arg("type_id"), py::arg("w"), py::arg("n_out"), py::arg("n_in"),
          py::arg("w_row_stride"), py::arg("x"), py::arg("n_tok"), py::arg("y"),
          py::arg("stream") = 0, release);
    m.def("matmul_multi",
          [](const std::vector<std::tuple<int, uintptr_t, int64_t, int64_t>>& weights, int64_t n_in,
             uintptr_t x, int64_t n_tok, uintptr_t y, int64_t ldy, uintptr_t stream) {
              no_stream(stream);
              std::vector<cpu::MatW> ws;
              for (const auto& [type_id, w, n_out, stride] : weights)
                  ws.push_back({type_id, ptr<const uint8_t>(w), n_out, stride});
              py::gil_scoped_release nogil;
              cpu::matmul_multi(ws.data(), int(ws.size()), n_in, ptr<const float>(x), n_tok,
                                ptr<float>(y), ldy);
          },
          py::arg("weights"), py::arg("n_in"), py::arg("x"), py::arg("n_tok"), py::arg("y"),
          py::arg("ldy"), py::arg("stream") = 0);
    m.def("attention",
          [](uintptr_t q, int64_t q_t, int64_t q_h, uintptr_t gate, int64_t g_t, int64_t g_h,
             uintptr_t k_cache, uintptr_t v_cache, int64_t n_attn, int64_t pos0, int64_t n_tok,
             int64_t hq, int64_t hkv, int64_t d, uintptr_t out, uintptr_t stream, int kv_type) {
              no_stream(stream);
              cpu::attention(ptr<const float>(q), q_t, q_h, ptr<const float>(gate), g_t, g_h,
                             ptr<const void>(k_cache), ptr<const void>(v_cache), n_attn, pos0, n_tok,
                             hq, hkv, d, ptr<float>(out), kv_type);
          },
          py::arg("q"), py::arg("q_t"), py::arg("q_h"), py::arg("gate"), py::arg("g_t"), py::arg("g_h"),
          py::arg("k_cache"), py::arg("v_cache"), py::arg("n_attn"), py::arg("pos0"), py::arg("n_tok"),
          py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("out"), py::arg("stream") = 0,
          py::arg("kv_type") = 0, release);
    m.attr("ATTENTION_KV_TYPES") = 4;  // attention reads f32, f16, q8_0 and q4_0 caches
    m.def("gated_attention",
          [](uintptr_t qg, int64_t ld_qg, uintptr_t k, uintptr_t v, int64_t ld_kv, uintptr_t q_norm,
             uintptr_t k_norm, float eps, int64_t pos0, int64_t n_tok, int64_t hq, int64_t hkv, int64_t d,
             int64_t n_rot, uintptr_t inv_freq, uintptr_t k_cache, uintptr_t v_cache, int64_t n_attn,
             uintptr_t q_work, uintptr_t out, uintptr_t stream, int kv_type) {
              no_stream(stream);
              cpu::gated_attention(ptr<const float>(qg), ld_qg, ptr<const float>(k), ptr<const float>(v),
                                   ld_kv, ptr<const float>(q_norm), ptr<const float>(k_norm), eps, pos0,
                                   n_tok, hq, hkv, d, n_rot, ptr<const float>(inv_freq), ptr<void>(k_cache),
                                   ptr<void>(v_cache), n_attn, ptr<float>(q_work), ptr<float>(out), kv_type);
          },
          py::arg("qg"), py::arg("ld_qg"), py::arg("k"), py::arg("v"), py::arg("ld_kv"), py::arg("q_norm"),
          py::arg("k_norm"), py::arg("eps"), py::arg("pos0"), py::arg("n_tok"), py::arg("hq"), py::arg("hkv"),
          py::arg("d"), py::arg("n_rot"), py::arg("inv_freq"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("n_attn"), py::arg("q_work"), py::arg("out"), py::arg("stream") = 0, py::arg("kv_type") = 0,
          release);
    m.def("moe_ffn",
          [](uintptr_t x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             uintptr_t ids, uintptr_t weights, int64_t top_k, int gate_type, uintptr_t gate,
             int64_t gate_stride, int up_type, uintptr_t up, int64_t up_stride, int down_type,
             uintptr_t down, int64_t down_stride, uintptr_t y, uintptr_t stream) {
              no_stream(stream);
              cpu::moe_ffn(ptr<const float>(x), n_tok, hidden, ff, n_experts,
                           ptr<const int32_t>(ids), ptr<const float>(weights), top_k,
                           {gate_type, ptr<const uint8_t>(gate), gate_stride},
                           {up_type, ptr<const uint8_t>(up), up_stride},
                           {down_type, ptr<const uint8_t>(down), down_stride}, ptr<float>(y));
          },
          py::arg("x"), py::arg("n_tok"), py::arg("hidden"), py::arg("ff"), py::arg("n_experts"),
          py::arg("ids"), py::arg("weights"), py::arg("top_k"), py::arg("gate_type"),
          py::arg("gate"), py::arg("gate_expert_stride"), py::arg("up_type"), py::arg("up"),
          py::arg("up_expert_stride"), py::arg("down_type"), py::arg("down"),
          py::arg("down_expert_stride"), py::arg("y"), py::arg("stream") = 0, release);
    m.def("residual_rms_norm",
          [](uintptr_t x, int64_t rows, int64_t n, uintptr_t a, int64_t lda, uintptr_t b, int64_t ldb,
             uintptr_t s, int64_t lds, uintptr_t w, float eps, uintptr_t out, uintptr_t stream) {
              no_stream(stream);
              cpu::residual_rms_norm(ptr<float>(x), rows, n, ptr<const float>(a), lda, ptr<const float>(b),
                                     ldb, ptr<const float>(s), lds, ptr<const float>(w), eps, ptr<float>(out));
          },
          py::arg("x"), py::arg("rows"), py::arg("n"), py::arg("a"), py::arg("lda"), py::arg("b"),
          py::arg("ldb"), py::arg("s"), py::arg("lds"), py::arg("w"), py::arg("eps"), py::arg("out"),
          py::arg("stream") = 0, release);
    m.def("route_topk",
          [](uintptr_t logits, int64_t rows, int64_t ld, int64_t n_experts, int64_t top_k, float floor,
             uintptr_t ids, uintptr_t weights, uintptr_t stream) {
              no_stream(stream);
              cpu::route_topk(ptr<const float>(logits), rows, ld, n_experts, top_k, floor,
                              ptr<int32_t>(ids), ptr<float>(weights));
          },
          py::arg("logits"), py::arg("rows"), py::arg("ld"), py::arg("n_experts"), py::arg("top_k"),
          py::arg("floor"), py::arg("ids"), py::arg("weights"), py::arg("stream") = 0, release);
    m.def("swiglu",
          [](uintptr_t gate, uintptr_t up, int64_t ld, int64_t rows, int64_t n, uintptr_t out,
             uintptr_t stream) {
              no_stream(stream);
              cpu::swiglu(ptr<const float>(gate), ptr<const float>(up), ld, rows, n, ptr<float>(out));
          },
          py::arg("gate"), py::arg("up"), py::arg("ld"), py::arg("rows"), py::arg("n"), py::arg("out"),
          py::arg("stream") = 0, release);
    m.def("conv_silu_step",
          [](uintptr_t x, int64_t ldx, uintptr_t state, uintptr_t w, int64_t batch,
             int64_t channels, int64_t kc, uintptr_t y, uintptr_t stream) {
              no_stream(stream);
              cpu::conv_silu_step(ptr<const float>(x), ldx, ptr<float>(state), ptr<const float>(w),
                                  batch, channels, kc, ptr<float>(y));
          },
          py::arg("x"), py::arg("ldx"), py::arg("conv_state"), py::arg("w"), py::arg("batch"),
          py::arg("channels"), py::arg("kc"), py::arg("y"), py::arg("stream") = 0, release);
    m.def("conv_silu_seq",
          [](uintptr_t x, int64_t ldx, uintptr_t state, uintptr_t w, int64_t batch, int64_t n_tok,
             int64_t channels, int64_t kc, uintptr_t y, uintptr_t stream) {
              no_stream(stream);
              cpu::conv_silu_seq(ptr<const float>(x), ldx, ptr<float>(state), ptr<const float>(w),
                                 batch, n_tok, channels, kc, ptr<float>(y));
          },
          py::arg("x"), py::arg("ldx"), py::arg("conv_state"), py::arg("w"), py::arg("batch"),
          py::arg("n_tok"), py::arg("channels"), py::arg("kc"), py::arg("y"), py::arg("stream") = 0,
          release);
    m.def("delta_rule_step",
          [](uintptr_t y, int64_t ldy, uintptr_t z, int64_t ldz, uintptr_t beta_raw,
             uintptr_t alpha_raw, int64_t ldg, uintptr_t ssm_a, uintptr_t dt_bias, uintptr_t S,
             uintptr_t norm_w, int64_t batch, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
             float eps, uintptr_t out, uintptr_t stream) {
              no_stream(stream);
              cpu::delta_rule_step(ptr<const float>(y), ldy, ptr<const float>(z), ldz,
                                   ptr<const float>(beta_raw), ptr<const float>(alpha_raw), ldg,
                                   ptr<const float>(ssm_a), ptr<const float>(dt_bias), ptr<float>(S),
                                   ptr<const float>(norm_w), batch, hk, hv, dk, dv, eps, ptr<float>(out));
          },
          py::arg("y"), py::arg("ldy"), py::arg("z"), py::arg("ldz"), py::arg("beta_raw"),
          py::arg("alpha_raw"), py::arg("ldg"), py::arg("ssm_a"), py::arg("dt_bias"), py::arg("S"),
          py::arg("norm_w"), py::arg("batch"), py::arg("hk"), py::arg("hv"), py::arg("dk"),
          py::arg("dv"), py::arg("eps"), py::arg("out"), py::arg("stream") = 0, release);
    m.def("delta_rule_seq",
          [](uintptr_t y, int64_t ldy, uintptr_t z, int64_t ldz, uintptr_t beta_raw,
             uintptr_t alpha_raw, int64_t ldg, uintptr_t ssm_a, uintptr_t dt_bias, uintptr_t S,
             uintptr_t norm_w, int64_t batch, int64_t n_tok, int64_t hk, int64_t hv, int64_t dk,
             int64_t dv, float eps, uintptr_t out, uintptr_t stream) {
              no_stream(stream);
              cpu::delta_rule_seq(ptr<const float>(y), ldy, ptr<const float>(z), ldz,
                                  ptr<const float>(beta_raw), ptr<const float>(alpha_raw), ldg,
                                  ptr<const float>(ssm_a), ptr<const float>(dt_bias), ptr<float>(S),
                                  ptr<const float>(norm_w), batch, n_tok, hk, hv, dk, dv, eps,
                                  ptr<float>(out));
          },
          py::arg("y"), py::arg("ldy"), py::arg("z"), py::arg("ldz"), py::arg("beta_raw"),
          py::arg("alpha_raw"), py::arg("ldg"), py::arg("ssm_a"), py::arg("dt_bias"), py::arg("S"),
          py::arg("norm_w"), py::arg("batch"), py::arg("n_tok"), py::arg("hk"), py::arg("hv"),
          py::arg("dk"), py::arg("dv"), py::arg("eps"), py::arg("out"), py::arg("stream") = 0, release);

    m.def("set_tables", [](const py::dict& tables) {
        for (auto item : tables) {
            const py::buffer_info info = py::reinterpret_borrow<py::buffer>(item.second).request();
            cpu::set_table(py::str(item.first), info.ptr, size_t(info.size * info.itemsize));
        }
    }, py::arg("tables"));
    m.def("tables_ready", &cpu::tables_ready);
    m.def("block_sizes", [] {
        py::dict out;
#define FT_X(NAME, BE, BB) out[#NAME] = py::make_tuple(BE, BB);
        FT_QUANT_TYPES(FT_X)
#undef FT_X
        return out;
    });
    m.def("repacked_type", [](int type_id) -> py::object {
        const int id = cpu::repacked_type(type_id);
        if (id < 0) return py::none();
        const auto& k = cpu::kernels().types[id];
        return py::make_tuple(id, std::string(k.name), k.kb_elems, k.kb_bytes);
    }, py::arg("type_id"));
    m.def("repack", [](int type_id, uintptr_t src, int64_t nblocks, uintptr_t dst, int64_t items,
                       int64_t src_stride, int64_t dst_stride) {
        cpu::repack(type_id, ptr<const uint8_t>(src), nblocks, ptr<uint8_t>(dst), items, src_stride, dst_stride);
    }, py::arg("type_id"), py::arg("src"), py::arg("nblocks"), py::arg("dst"), py::arg("items") = 1,
       py::arg("src_stride") = 0, py::arg("dst_stride") = 0, release);
    m.def("dequantize_types", &type_names);
    m.def("matmul_types", &type_names);
    m.def("moe_ffn_types", &type_names);
    m.def("accumulation", [](const std::string& name) {
        for (int id = 0; id < cpu::kMaxTypeId; ++id) {
            const auto& k = cpu::kernels().types[id];
            if (k.dot_row && name == k.name) return std::string(k.accumulation);
        }
        throw std::invalid_argument("no CPU kernel for type '" + name + "'");
    }, py::arg("name"));
    m.def("quantize_q8", [](uintptr_t x, int64_t n_tok, int64_t n, uintptr_t q, uintptr_t d, uintptr_t m16) {
        const cpu::IsaKernels& isa = cpu::kernels();
        if (!isa.quantize_act)
            throw std::invalid_argument(std::string("CPU ISA '") + isa.name + "' keeps activations in float");
        if (n <= 0 || n % 32) throw std::invalid_argument("quantize_q8: n must be a positive multiple of 32");
        isa.quantize_act(ptr<const float>(x), n, 0, n_tok, n, ptr<int8_t>(q), ptr<float>(d), ptr<float>(m16));
    }, py::arg("x"), py::arg("n_tok"), py::arg("n"), py::arg("q"), py::arg("d"), py::arg("m16"));
    m.def("quantize_q16", [](uintptr_t x, int64_t n_tok, int64_t n, uintptr_t q, uintptr_t d, uintptr_t s) {
        const cpu::IsaKernels& isa = cpu::kernels();
        if (!isa.quantize_act16)
            throw std::invalid_argument(std::string("CPU ISA '") + isa.name + "' keeps activations in float");
        if (n <= 0 || n % 32) throw std::invalid_argument("quantize_q16: n must be a positive multiple of 32");
        isa.quantize_act16(ptr<const float>(x), n, 0, n_tok, n, ptr<int16_t>(q), ptr<float>(d), ptr<float>(s));
    }, py::arg("x"), py::arg("n_tok"), py::arg("n"), py::arg("q"), py::arg("d"), py::arg("s"));
    m.def("set_threads", &cpu::set_num_threads, py::arg("n"));
    m.def("threads", &cpu::num_threads);
    m.def("hold_threads", &cpu::hold_threads, py::arg("on"));
    m.def("set_pin_threads", &cpu::set_pin_threads, py::arg("on"));
    m.def("iq3s_grid", &cpu::iq3s_grid);
    m.def("set_iq3s_grid", &cpu::set_iq3s_grid, py::arg("how"));
    m.def("threads_pinned", &cpu::threads_pinned);
    m.def("isa", [] { return std::string(cpu::kernels().name); });
    m.def("available_isas", &cpu::available_isas);
    m.def("set_isa", &cpu::set_isa, py::arg("name"));

    // ---- offload runtime: the CPU worker of the decode step (csrc/cpu/offload_worker.h) --------
    //   OffloadWorker(exchange: dict, layers: [dict], timeout_ms)   starts the thread
    //       layers[L] = {"gate"|"up"|"down": (type_id, base, expert_stride), "ff", "n_experts"}
    //   .begin_step(step, n_tok)   arm for a step (non-blocking; steps queue, increasing)
    //   .wait_step(upto=all)       block until steps <= upto are done (GIL released); raises
    //                              the first worker error since the last wait
    //   .in_flight()               steps armed and not yet done
    //   .busy_ns(), .experts()     per-layer cumulative compute time and experts computed
    // ---- a whole CPU decode token in one call (csrc/cpu/decode_loop.h) ------------------------
    //   DecodePlan(model: dict, layers: [dict])   pointers as ints; projections as
    //       (type_id, w, n_out, row_stride), expert banks as (type_id, base, expert_stride); the
    //       caller keeps every buffer alive while the plan lives (moe_offload/models/decode_loop.py)
    //   .run(token, pos, n_attn, logits)   one token (GIL released): logits f32 [n_vocab]
    //   .run_tokens(tokens, pos, n_attn, keep, last_only, logits, hidden)   T <= MAX_TOKENS tokens
    //       of the one sequence (a verify step; keep: the delta-net states after each kept, see
    //       set_steps): logits f32 [T or 1, n_vocab], hidden (0: none) f32 [T, n_embd]
    //   .run_hidden(x, n_tok, pos, n_attn, last_only, logits, hidden)   run_tokens from the residual
    //       stream x f32 [T, n_embd] (the MTP block after its eh_proj); logits 0: no head
    //   .set_steps(steps, depth)   the State's kept steps: per layer (conv, ssm) addresses (0, 0
    //       for attention layers), depth states each; depth 0 drops them
    //   DecodePlan.run_many(plans, tokens, pos, n_attn, logits)   a token for each of B sequences,
    //       plan b holding sequence b's State, all of one model (GIL released): logits [B, n_vocab]
    //   DecodePlan.MAX_SEQUENCES   run_many's largest B
    py::class_<cpu::DecodePlan>(m, "DecodePlan")
        .def(py::init([](const py::dict& model, const py::list& layers) {
                 auto mat = [](const py::handle& h) {
                     auto t = h.cast<std::tuple<int, uintptr_t, int64_t, int64_t>>();
                     return cpu::MatW{std::get<0>(t), ptr<const uint8_t>(std::get<1>(t)), std::get<2>(t),
                                      std::get<3>(t)};
                 };
                 auto mats = [&](const py::handle& h) {
                     std::vector<cpu::MatW> out;
                     for (auto w : h) out.push_back(mat(w));
                     return out;
                 };
                 auto f32 = [](const py::dict& d, const char* k) {
                     return d.contains(k) ? ptr<float>(d[k].cast<uintptr_t>()) : nullptr;
                 };
                 auto i64 = [](const py::dict& d, const char* k) { return d[k].cast<int64_t>(); };
                 cpu::DecodeModel md;
                 md.n_embd = i64(model, "n_embd"), md.n_vocab = i64(model, "n_vocab");
                 md.eps = model["eps"].cast<float>(), md.expert_floor = model["expert_floor"].cast<float>();
                 md.n_expert = i64(model, "n_expert"), md.top_k = i64(model, "top_k");
                 md.ssm_hk = i64(model, "ssm_hk"), md.ssm_hv = i64(model, "ssm_hv");
                 md.ssm_dk = i64(model, "ssm_dk"), md.ssm_dv = i64(model, "ssm_dv");
                 md.n_head = i64(model, "n_head"), md.n_head_kv = i64(model, "n_head_kv");
                 md.head_dim = i64(model, "head_dim"), md.n_rot = i64(model, "n_rot"), md.n_ctx = i64(model, "n_ctx");
                 md.inv_freq = f32(model, "inv_freq");
                 auto embd = model["embd"].cast<std::tuple<int, uintptr_t, int64_t>>();
                 md.embd_type = std::get<0>(embd), md.embd = ptr<const uint8_t>(std::get<1>(embd));
                 md.embd_row_bytes = std::get<2>(embd);
                 md.out_norm = f32(model, "out_norm");
                 md.head = mat(model["head"]);
                 std::vector<cpu::DecodeLayer> ls;
                 for (auto item : layers) {
                     const py::dict d = py::reinterpret_borrow<py::dict>(item);
                     cpu::DecodeLayer L;
                     L.recurrent = d["recurrent"].cast<bool>();
                     L.attn_norm = f32(d, "attn_norm"), L.post_norm = f32(d, "post_norm");
                     L.mixer_in = mats(d["mixer_in"]), L.mixer_out = mat(d["mixer_out"]);
                     L.conv_state = f32(d, "conv_state"), L.conv_w = f32(d, "conv_w");
                     L.conv_kc = d.contains("conv_kc") ? i64(d, "conv_kc") : 0;
                     L.ssm_state = f32(d, "ssm_state"), L.ssm_a = f32(d, "ssm_a");
                     L.dt_bias = f32(d, "dt_bias"), L.ssm_norm = f32(d, "ssm_norm");
                     L.q_norm = f32(d, "q_norm"), L.k_norm = f32(d, "k_norm");
                     L.k_cache = ptr<void>(d.contains("k_cache") ? d["k_cache"].cast<uintptr_t>() : 0);
                     L.v_cache = ptr<void>(d.contains("v_cache") ? d["v_cache"].cast<uintptr_t>() : 0);
                     L.kv_type = d.contains("kv_type") ? int(i64(d, "kv_type")) : 0;
                     L.ffn_in = mats(d["ffn_in"]);
                     if (d.contains("shared_down")) L.shared_down = mat(d["shared_down"]);
                     auto bank = [&](const char* k) {
                         auto t = d[k].cast<std::tuple<int, uintptr_t, int64_t>>();
                         return cpu::Bank{std::get<0>(t), ptr<const uint8_t>(std::get<1>(t)), std::get<2>(t)};
                     };
                     L.gate = bank("gate"), L.up = bank("up"), L.down = bank("down");
                     L.n_ff = i64(d, "n_ff"), L.n_bank_experts = i64(d, "n_bank_experts");
                     ls.push_back(std::move(L));
                 }
                 return std::make_unique<cpu::DecodePlan>(md, std::move(ls));
             }),
             py::arg("model"), py::arg("layers"))
        .def("run",
             [](cpu::DecodePlan& p, int64_t token, int64_t pos, int64_t n_attn, uintptr_t logits) {
                 p.run(token, pos, n_attn, ptr<float>(logits));
             },
             py::arg("token"), py::arg("pos"), py::arg("n_attn"), py::arg("logits"), release)
        .def("run_tokens",
             [](cpu::DecodePlan& p, const std::vector<int64_t>& tokens, int64_t pos, int64_t n_attn, bool keep,
                bool last_only, uintptr_t logits, uintptr_t hidden) {
                 p.run_tokens(tokens.data(), int64_t(tokens.size()), pos, n_attn, keep, last_only, ptr<float>(logits),
                              ptr<float>(hidden));
             },
             py::arg("tokens"), py::arg("pos"), py::arg("n_attn"), py::arg("keep"), py::arg("last_only"),
             py::arg("logits"), py::arg("hidden"), release)
        .def("run_hidden",
             [](cpu::DecodePlan& p, uintptr_t x, int64_t n_tok, int64_t pos, int64_t n_attn, bool last_only,
                uintptr_t logits, uintptr_t hidden) {
                 p.run_hidden(ptr<const float>(x), n_tok, pos, n_attn, last_only, ptr<float>(logits),
                              ptr<float>(hidden));
             },
             py::arg("x"), py::arg("n_tok"), py::arg("pos"), py::arg("n_attn"), py::arg("last_only"),
             py::arg("logits"), py::arg("hidden"), release)
        .def("set_steps",
             [](cpu::DecodePlan& p, const std::vector<std::pair<uintptr_t, uintptr_t>>& steps, int64_t depth) {
                 std::vector<std::pair<float*, float*>> ptrs;
                 for (const auto& [c, s] : steps) ptrs.emplace_back(ptr<float>(c), ptr<float>(s));
                 p.set_steps(ptrs, depth);
             },
             py::arg("steps"), py::arg("depth"))
        .def_static(
            "run_many",
            [](const std::vector<cpu::DecodePlan*>& plans, const std::vector<int64_t>& tokens,
               const std::vector<int64_t>& pos, const std::vector<int64_t>& n_attn, uintptr_t logits) {
                if (tokens.size() != plans.size() || pos.size() != plans.size() || n_attn.size() != plans.size())
                    throw std::invalid_argument("DecodePlan.run_many: one token, pos and n_attn per plan");
                cpu::DecodePlan::run_many(plans, tokens.data(), pos.data(), n_attn.data(), ptr<float>(logits));
            },
            py::arg("plans"), py::arg("tokens"), py::arg("pos"), py::arg("n_attn"), py::arg("logits"), release)
        .def_readonly_static("MAX_SEQUENCES", &cpu::DecodePlan::kMaxSequences)
        .def_readonly_static("MAX_TOKENS", &cpu::DecodePlan::kMaxTokens);

    py::class_<cpu::OffloadWorker>(m, "OffloadWorker")
        .def(py::init([](const py::dict& exchange, const py::list& layers, int64_t timeout_ms) {
                 std::vector<cpu::WorkerLayer> ls;
                 for (auto item : layers) {
                     const py::dict d = py::reinterpret_borrow<py::dict>(item);
                     auto bank = [&](const char* k) {
                         auto t = d[k].cast<std::tuple<int, uintptr_t, int64_t>>();
                         return cpu::Bank{std::get<0>(t), ptr<const uint8_t>(std::get<1>(t)),
                                          std::get<2>(t)};
                     };
                     ls.push_back({bank("gate"), bank("up"), bank("down"), d["ff"].cast<int64_t>(),
                                   d["n_experts"].cast<int64_t>()});
                 }
                 return std::make_unique<cpu::OffloadWorker>(exchange_from(exchange), std::move(ls),
                                                             timeout_ms);
             }),
             py::arg("exchange"), py::arg("layers"), py::arg("timeout_ms"))
        .def("begin_step", &cpu::OffloadWorker::begin_step, py::arg("step"), py::arg("n_tok"))
        .def("wait_step", &cpu::OffloadWorker::wait_step, py::arg("upto") = INT32_MAX, release)
        .def("in_flight", &cpu::OffloadWorker::in_flight)
        .def("busy_ns", &cpu::OffloadWorker::busy_ns)
        .def("experts", &cpu::OffloadWorker::experts);
}
