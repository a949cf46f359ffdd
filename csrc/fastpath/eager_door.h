// The eager door: serve(), the Python function of this module that an eager CSRMatrix product
// calls without the dispatcher (Python C-API).
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// staging.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

// Whether t is a plain strided tensor that nothing but its backend kernel needs to see: no
// tensor subclass (Python key), no functorch wrapper, no functionalization, no lazy conjugate.
bool plain(const at::Tensor& t) {
  constexpr c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                         c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                         c10::DispatchKey::Functionalize, c10::DispatchKey::Conjugate,
                                         c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
  return t.layout() == c10::kStrided && !t.key_set().has_any(wrapped);
}

// serve(op, crow, col, val, ncols, X) -> Tensor | None: an eager product of a CSRMatrix served
// from the registry without the dispatcher (op: 0..4 as in kOpNames). None where the call is
// not the registry's (a miss), or where something other than the backend kernel must see it:
// autograd (grad mode with an operand that requires grad), autocast, a dispatch mode, wrapped
// operands. The caller then runs the Python path, which checks, decides and records.
PyObject* py_serve(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_Format(PyExc_TypeError, "sparserl fast path serve(): expected 6 arguments (op, crow, col, val, ncols, X), "
                 "got %zd", nargs);
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[0]);
  const long long ncols = PyLong_AsLongLong(args[4]);
  if ((op == -1 || ncols == -1) && PyErr_Occurred()) return nullptr;
  if (op < SPMM || op > SDDMM) {
    PyErr_Format(PyExc_ValueError, "sparserl fast path serve(): op must be 0..4 (got %lld)", op);
    return nullptr;
  }
  for (int i : {1, 2, 3, 5}) {
    if (!THPVariable_CheckExact(args[i])) Py_RETURN_NONE;  // a subclass or not a tensor: Python's path
  }
  try {
    const at::Tensor& crow = THPVariable_Unpack(args[1]);
    const at::Tensor& col = THPVariable_Unpack(args[2]);
    const at::Tensor& val = THPVariable_Unpack(args[3]);
    const at::Tensor& X = THPVariable_Unpack(args[5]);
    if (!X.is_cuda() || !plain(X) || !plain(val) || c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
        at::autocast::is_autocast_enabled(at::kCUDA) ||
        (c10::GradMode::is_enabled() && (X.requires_grad() || val.requires_grad())))
      Py_RETURN_NONE;
    auto out = hit(op, crow, col, val, ncols, X);
    if (!out) Py_RETURN_NONE;
    return THPVariable_Wrap(*std::move(out));
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
}

}  // namespace
