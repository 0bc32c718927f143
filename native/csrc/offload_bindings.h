// Python dict -> offload descriptor structs, shared by bindings_cpu.cpp and bindings_cuda.cpp.
// native/offload_native.py builds the dicts (addresses as ints) once per layout.
#pragma once
#include <pybind11/pybind11.h>

#include "offload_exchange.h"
#include "quants.h"

namespace ft {

template <class T> T* dict_ptr(const pybind11::dict& d, const char* key) {
    return reinterpret_cast<T*>(d[key].cast<uintptr_t>());
}

// The constants Python shares with the kernels, as module attributes of both extensions (the CPU
// one is always built, so CI checks them; native.offload_native reads them from there):
//   MAX_SELECTIONS   T * K a decode step's layer may select (fetch lists hold that many entries)
//   STATS_COLUMNS    names of CacheTables::stats' columns, in order
//   SCORE_ONE, SCORE_STEPS   the eviction score's fixed point and the decay table's length
//   OUTPUT_DTYPES    {name: ggml id} of dequantize's output types (F32, F16, BF16)
//   LINK_WORDS       {name: index} of the emulated link's words (LinkWord)
inline void export_protocol(pybind11::module_& m) {
    namespace py = pybind11;
    m.attr("MAX_SELECTIONS") = kMaxSelections;
    py::tuple cols(static_cast<size_t>(kStatsCols));
    for (int i = 0; i < kStatsCols; ++i) cols[i] = py::str(kStatsNames[i]);
    m.attr("STATS_COLUMNS") = cols;
    m.attr("SCORE_ONE") = kScoreOne;
    m.attr("SCORE_STEPS") = kScoreSteps;
    py::dict dtypes;
    dtypes["F32"] = int(QType::F32);
    dtypes["F16"] = int(QType::F16);
    dtypes["BF16"] = int(QType::BF16);
    m.attr("OUTPUT_DTYPES") = dtypes;
    py::dict link;
    link["free_at"] = int(kLinkFreeAt);
    link["mark"] = int(kLinkMark);
    link["marks"] = int(kLinkMarks);
    link["ns_per_byte"] = int(kLinkNsPerByte);
    link["bytes"] = int(kLinkBytes);
    link["words"] = int(kLinkWords);
    m.attr("LINK_WORDS") = link;
}

inline CacheTables cache_tables_from(const pybind11::dict& d) {
    CacheTables t;
    t.slot_of_expert = dict_ptr<int32_t>(d, "slot_of_expert");
    t.expert_of_slot = dict_ptr<int32_t>(d, "expert_of_slot");
    t.slot_last_use = dict_ptr<int32_t>(d, "slot_last_use");
    t.slot_pinned = dict_ptr<int32_t>(d, "slot_pinned");
    t.expert_freq = dict_ptr<int32_t>(d, "expert_freq");
    t.n_slots = dict_ptr<int32_t>(d, "n_slots");
    t.stats = dict_ptr<int32_t>(d, "stats");
    t.cpu_pending = dict_ptr<int32_t>(d, "cpu_pending");
    t.expert_score = dict_ptr<int32_t>(d, "expert_score");
    t.expert_seen = dict_ptr<int32_t>(d, "expert_seen");
    t.score_decay = dict_ptr<int32_t>(d, "score_decay");
    t.n_experts = d["n_experts"].cast<int>();
    t.max_slots = d["max_slots"].cast<int>();
    return t;
}

inline Exchange exchange_from(const pybind11::dict& d) {
    Exchange e;
    e.gpu_flag = dict_ptr<int32_t>(d, "gpu_flag");
    e.cpu_flag = dict_ptr<int32_t>(d, "cpu_flag");
    e.cpu_ids = dict_ptr<int32_t>(d, "cpu_ids");
    e.cpu_w = dict_ptr<float>(d, "cpu_w");
    e.x_host = dict_ptr<float>(d, "x_host");
    e.y_host = dict_ptr<float>(d, "y_host");
    e.n_tok = d["n_tok"].cast<int>();
    e.max_tok = d["max_tok"].cast<int>();
    e.top_k = d["top_k"].cast<int>();
    e.hidden = d["hidden"].cast<int>();
    return e;
}

}  // namespace ft
