// Python binding of kvplug's copy kernel (built by kvplug.runtime.gpu.kernel.load_kernel).
#include <torch/extension.h>

#include "kvplug_copy.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvplug's paged-KV copy kernel (see csrc/kvplug_copy.h).";
  m.def("transfer", &kvplug::transfer,
        "Gather (to_chunk=True) or scatter (to_chunk=False) every layer and plane of one chunk "
        "in one launch on the current CUDA stream; returns without synchronizing.",
        py::arg("chunk"), py::arg("plane_pointers"), py::arg("slot_mapping"),
        py::arg("slot_stride_bytes"), py::arg("vec_bytes"), py::arg("to_chunk"));
}
