// pybind11 definitions of native._cpu: the whole CPU API in one place (placeholder until the kernels land).
#include <pybind11/pybind11.h>
namespace py = pybind11;

PYBIND11_MODULE(_cpu, m) {
    m.doc() = "ftpatch CPU kernels on raw ggml blocks";
    m.def("version", []() { return 1; });
}
