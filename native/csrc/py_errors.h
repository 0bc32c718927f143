// Bad arguments reach Python as native.errors.NativeError (a ValueError), shared by both
// extensions: the CLI prints our own errors as one line, and a std::invalid_argument from a
// kernel's checks (an unsupported type, a wrong shape, a bad tuning variable) is ours.
#pragma once
#include <exception>
#include <stdexcept>

#include <pybind11/pybind11.h>

namespace ft {

inline void register_native_error() {
    // held for the life of the process: the translator may run at any call
    namespace py = pybind11;
    static PyObject* native_error =
        py::object(py::module_::import("native.errors").attr("NativeError")).release().ptr();
    py::register_local_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const std::invalid_argument& e) {
            PyErr_SetString(native_error, e.what());
        }
    });
}

}  // namespace ft
