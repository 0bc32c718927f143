// pybind11 definitions of native._cuda (placeholder until the kernels land).
#include <pybind11/pybind11.h>
namespace py = pybind11;

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "ftpatch CUDA kernels on raw ggml blocks";
    m.def("version", []() { return 1; });
}
