// The library's definitions: the module's functions and init function, the sparserl_fastpath
// operators' schemas, and the C++ kernels registered for sparserl_fast::* and sparserl::* on CUDA.
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// intake.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

#define SPARSERL_CONCAT_(a, b) a##b
#define SPARSERL_CONCAT(a, b) SPARSERL_CONCAT_(a, b)

namespace {

// The module's Python functions: the doors that skip the dispatcher (eager_door.h, intake.h).
PyMethodDef methods[] = {
    {"serve", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&py_serve)), METH_FASTCALL,
     "serve(op, crow, col, val, ncols, X) -> Tensor | None: an eager CSRMatrix product from the registry"},
    {"intake", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&py_intake)), METH_FASTCALL,
     "intake(crow, col, val, nrows, ncols, function, host, work, block, per_thread, max_grid) -> "
     "(crow, col, result, stream) | None: a caller's CUDA indices copied and checked by the fused kernel"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "sparserl_fastpath", nullptr, -1, methods};

}  // namespace

// The module is imported under the library's name (jit/fastpath.py: its build and load); importing
// it also registers the operators below.
PyMODINIT_FUNC SPARSERL_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }

TORCH_LIBRARY(sparserl_fastpath, m) {
  m.def(
      "install(Tensor crow, Tensor col, int ncols, int op, int n, ScalarType dtype, int nnz, int in_rows, "
      "int out_rows, Tensor? rowptr, Tensor? colidx, Tensor? perm, int launcher, int[] geometry, Tensor? aux, "
      "int[] ints, bool init_zero, int work_numel, int vendor_cols, int function=0, bool work_once=False) -> ()",
      &install);
  m.def("forget() -> ()", &forget);
  m.def("entries() -> int", &entries);
  m.def("bare_launch_us(Tensor crow, Tensor col, Tensor val, int ncols, Tensor X, int op, int calls) -> float",
        &bare_launch_us);
  m.def("served_us(Tensor crow, Tensor col, Tensor val, int ncols, Tensor X, int op, int calls) -> float",
        &served_us);
  m.def("host_costs_us(Tensor like, int calls) -> float[]", &host_costs_us);
  m.def("driver_functions() -> bool", [] { return driver_launch() != nullptr; });
  // whether vendor entries call cuSPARSE directly (else through at::addmm / at::addmv)
  m.def("cusparse_direct() -> bool", [] {
#if SPARSERL_CUSPARSE
    return cusparse_api() != nullptr;
#else
    return false;
#endif
  });
  // whether vendor entries made from now on preprocess their SpMV (returns the previous setting)
  m.def("cusparse_preprocess(bool on) -> bool", [](bool on) {
#if SPARSERL_CUSPARSE
    return spmv_preprocess_on.exchange(on);
#else
    return false;
#endif
  });
  // A @ X or Aᵀ @ X by cuSPARSE on A's own arrays, nothing kept (no transpose computed); None
  // where it cannot
  m.def("cusparse_once(Tensor crow, Tensor col, Tensor val, int ncols, Tensor X, bool transposed) -> Tensor?",
        [](const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val, int64_t ncols,
           const at::Tensor& X, bool transposed) -> std::optional<at::Tensor> {
#if SPARSERL_CUSPARSE
          return cusparse_once(crow, col, val, ncols, X, transposed);
#else
          return std::nullopt;
#endif
        });
  // host CSR arrays to a CUDA device, the indices checked as they are copied; [] where it cannot
  m.def("stage_csr(Tensor crow, Tensor col, Tensor? val, int nrows, int ncols, Device device, int young_ns=0) -> "
        "Tensor[]", &stage_csr);
  m.def("young_patterns() -> int", [] { return static_cast<int64_t>(young_size.load(std::memory_order_relaxed)); });
  m.def("bind_counters(Tensor counters) -> ()", &bind_counters);
}

TORCH_LIBRARY_IMPL(sparserl_fast, CUDA, m) {
  m.impl("spmm", &product<SPMM>);
  m.impl("spmv", &product<SPMV>);
  m.impl("spmm_transposed", &product<SPMM_T>);
  m.impl("spmv_transposed", &product<SPMV_T>);
}

// The public operators' CUDA kernels: below their autograd (custom_op's, in Python), above
// their Python implementation, which a miss reaches through sparserl_direct.
TORCH_LIBRARY_IMPL(sparserl, CUDA, m) {
  m.impl("spmm", &product<SPMM>);
  m.impl("spmv", &product<SPMV>);
  m.impl("spmm_transposed", &product<SPMM_T>);
  m.impl("spmv_transposed", &product<SPMV_T>);
  m.impl("sddmm", &sddmm_product);
}
