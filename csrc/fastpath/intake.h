// The intake of a caller's CUDA indices (intake): ts.csr's metadata checks, the allocation of the
// library's copies and of the check's result words, and the launch of the fused intake kernel
// (torch_sparserl/toolchain/intake.py: copy, check, repair, verdict) in one call from Python.
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// eager_door.h (plain): it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

// One launch of the fused intake kernel: its eleven parameters are 8 bytes each (pointers and
// long longs), in the order of SPARSERL_INTAKE's signature. False where the driver refused it.
bool launch_intake(void* function, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& crow_dst,
                   const at::Tensor& col_dst, int64_t ncols, uint64_t work, const at::Tensor& scratch, uint64_t host,
                   int64_t block, int64_t per_thread, int64_t max_grid, cudaStream_t stream) {
  const int64_t rows = crow.size(0) - 1, nnz = col.size(0);
  const int64_t threads = (std::max(rows + 1, nnz) + per_thread - 1) / per_thread;
  const int64_t blocks = std::max<int64_t>(1, std::min(max_grid, (threads + block - 1) / block));
  uint64_t values[11] = {reinterpret_cast<uint64_t>(crow.data_ptr()),
                         reinterpret_cast<uint64_t>(col.data_ptr()),
                         reinterpret_cast<uint64_t>(crow_dst.data_ptr()),
                         reinterpret_cast<uint64_t>(col_dst.data_ptr()),
                         static_cast<uint64_t>(rows),
                         static_cast<uint64_t>(nnz),
                         static_cast<uint64_t>(ncols),
                         1,  // copy
                         work,
                         reinterpret_cast<uint64_t>(scratch.data_ptr()),
                         host};
  void* params[11];
  for (int i = 0; i < 11; ++i) params[i] = &values[i];
  return driver_launch()(function, static_cast<unsigned>(blocks), 1, 1, static_cast<unsigned>(block), 1, 1, 0,
                         stream, params, nullptr) == 0;
}

// Whether (crow, col, val) and the shape pass every check ts.csr's Python path makes of a CUDA
// triple's metadata, and the fused kernel can take them: one device (the current one), 1-D
// contiguous indices of one dtype (int32 or int64, within int32's range where int32), at least
// one row, nrows + 1 row pointers, val (where given) 1-D floating values of nnz elements. Not
// under inference mode nor a CUDA graph capture (the Python path makes ordinary tensors there,
// and copies checked inside the graph).
bool intake_applies(const at::Tensor& crow, const at::Tensor& col, const at::Tensor* val, int64_t nrows,
                    int64_t ncols) {
  const auto index = crow.scalar_type();
  if (!crow.is_cuda() || col.device() != crow.device() || crow.device().index() != c10::cuda::current_device() ||
      !plain(crow) || !plain(col) || col.scalar_type() != index || (index != at::kInt && index != at::kLong) ||
      crow.dim() != 1 || col.dim() != 1 || !crow.is_contiguous() || !col.is_contiguous() || nrows < 1 ||
      ncols < 0 || crow.size(0) != nrows + 1)
    return false;
  const int64_t nnz = col.size(0), int32_max = std::numeric_limits<int32_t>::max();
  if (index == at::kInt && (nrows > int32_max || ncols > int32_max || nnz > int32_max)) return false;
  if (val != nullptr && (val->device() != crow.device() || !plain(*val) || val->dim() != 1 || val->size(0) != nnz ||
                         !at::isFloatingType(val->scalar_type())))
    return false;
  if (c10::InferenceMode::is_enabled()) return false;
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}

// intake(crow, col, val, nrows, ncols, function, host, work, block, per_thread, max_grid)
//   -> (crow copy, col copy, result words, stream) | None
// The library's copies of a caller's CUDA indices, made, checked and repaired by one launch of the
// fused kernel (`function`, its CUfunction for the indices' dtype) on the current stream, with
// `host` (the device address of the pinned slot its verdict goes to) and `work` (the slot's two
// work words); `result` is the kernel's two result words (bad, bits), which products read. `val`
// (or None) is checked with the metadata. None where intake_applies declines or the driver refused
// the launch (nothing was queued then): the caller's Python path makes the copies, checks and
// names what is wrong.
PyObject* py_intake(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_Format(PyExc_TypeError, "sparserl fast path intake(): expected 11 arguments (crow, col, val, nrows, ncols, "
                 "function, host, work, block, per_thread, max_grid), got %zd", nargs);
    return nullptr;
  }
  int64_t ints[8];
  for (int i = 0; i < 8; ++i) {
    ints[i] = PyLong_AsLongLong(args[3 + i]);
    if (ints[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  const int64_t nrows = ints[0], ncols = ints[1], block = ints[5], per_thread = ints[6], max_grid = ints[7];
  void* function = reinterpret_cast<void*>(ints[2]);
  if (function == nullptr || block < 32 || block > 1024 || per_thread < 1 || max_grid < 1) {
    PyErr_SetString(PyExc_ValueError, "sparserl fast path intake(): expected a kernel function, block in [32, 1024], "
                    "per_thread >= 1 and max_grid >= 1");
    return nullptr;
  }
  if (!THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) ||
      (args[2] != Py_None && !THPVariable_CheckExact(args[2])) || driver_launch() == nullptr)
    Py_RETURN_NONE;
  try {
    const at::Tensor& crow = THPVariable_Unpack(args[0]);
    const at::Tensor& col = THPVariable_Unpack(args[1]);
    const at::Tensor* val = args[2] == Py_None ? nullptr : &THPVariable_Unpack(args[2]);
    if (!intake_applies(crow, col, val, nrows, ncols)) Py_RETURN_NONE;
    const c10::DeviceIndex device = crow.device().index();
    // a driver launch needs a current context; since CUDA 12, setting the device makes the
    // primary context current on a thread whose CUDA calls all hit torch's caches until now
    thread_local int context_of = -1;
    if (context_of != device) {
      C10_CUDA_CHECK(cudaSetDevice(device));
      context_of = device;
    }
    at::Tensor crow_dst = at::empty({nrows + 1}, crow.options());
    at::Tensor col_dst = at::empty({col.size(0)}, col.options());
    at::Tensor scratch = at::empty({2}, crow.options().dtype(at::kInt));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (!launch_intake(function, crow, col, crow_dst, col_dst, ncols, static_cast<uint64_t>(ints[4]), scratch,
                       static_cast<uint64_t>(ints[3]), block, per_thread, max_grid, stream))
      Py_RETURN_NONE;
    PyObject* out = PyTuple_New(4);
    if (out == nullptr) return nullptr;
    PyTuple_SET_ITEM(out, 0, THPVariable_Wrap(std::move(crow_dst)));
    PyTuple_SET_ITEM(out, 1, THPVariable_Wrap(std::move(col_dst)));
    PyTuple_SET_ITEM(out, 2, THPVariable_Wrap(std::move(scratch)));
    PyTuple_SET_ITEM(out, 3, PyLong_FromUnsignedLongLong(reinterpret_cast<uint64_t>(stream)));
    return out;
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
}

}  // namespace
