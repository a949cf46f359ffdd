// Serving a call from the registry: an entry's kernel launched (launch_kernel: its C launcher or
// cuLaunchKernel), a vendor entry's product (cuSPARSE, or torch's call), the hit-or-miss of a
// call (hit), and the CUDA kernels the dispatcher calls (product<OP>, sddmm_product), which
// send a miss to sparserl_direct.
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// cusparse_calls.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

at::Tensor aligned(const at::Tensor& t) {
  // the kernels' vector loads need contiguous, 16-byte aligned operands (Runtime.launch)
  if (t.is_contiguous() && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// Zeroes a fresh contiguous tensor with one cudaMemsetAsync on the launch's stream: in a
// CPU-bound epoch at::zeros (a fill kernel through TensorIterator) would be most of a
// product's host time.
void zero_fill(const at::Tensor& t, cudaStream_t stream) {
  if (t.numel()) C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), stream));
}

// One launch of an entry's kernel on operands already checked and allocated (serve, and the
// bare launches the benchmarks measure the host path against).
void launch_kernel(const Entry& e, const at::Tensor& rowptr, const at::Tensor& colidx, const at::Tensor& val,
                   const at::Tensor& X, const at::Tensor& y, const at::Tensor& work, cudaStream_t stream) {
  void* pointers[7] = {rowptr.data_ptr(), colidx.data_ptr(), val.numel() ? val.data_ptr() : nullptr,
                       X.numel() ? X.data_ptr() : nullptr, y.data_ptr(),
                       e.aux.defined() && e.aux.numel() ? e.aux.data_ptr() : nullptr,
                       work.defined() ? work.data_ptr() : nullptr};
  int ints[5] = {e.ints[0], e.ints[1], e.ints[2], e.ints[3], e.ints[4]};
  void* params[12];
  for (int i = 0; i < 7; ++i) params[i] = &pointers[i];
  for (int i = 0; i < 5; ++i) params[7 + i] = &ints[i];
  if (e.launch != nullptr) {
    const int err = e.launch(e.grid, e.block, e.smem, stream, params);
    TORCH_CHECK(err == 0, "sparserl kernel launch: cudaLaunchKernel failed with cudaError ", err, " (grid=", e.grid,
                ", block=", e.block, ", smem=", e.smem, ")");
  } else {
    const int err = driver_launch()(e.function, e.grid, 1, 1, e.block, 1, 1, e.smem, stream, params, nullptr);
    TORCH_CHECK(err == 0, "sparserl kernel launch: cuLaunchKernel failed with CUresult ", err, " (grid=", e.grid,
                ", block=", e.block, ", smem=", e.smem, ")");
  }
}

// Serves a call with the indices its pattern validated: the entry's rowptr and colidx (the
// pattern's private copy of a caller's tensors, int32 copies, the transpose), or the call's
// crow and col where those are the library's own validated tensors (none recorded then, so
// that the entry holds no strong reference to them).
at::Tensor serve(Entry& e, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val_in,
                 const at::Tensor& X_in) {
  const bool matrix = (e.op == SPMM || e.op == SPMM_T);
  const at::Tensor& rowptr = e.rowptr.defined() ? e.rowptr : crow;
  const at::Tensor& colidx = e.colidx.defined() ? e.colidx : col;
  c10::cuda::CUDAGuard guard(X_in.device());
  if (e.vendor) {
    count(1);
#if SPARSERL_CUSPARSE
    if (auto out = cusparse_product(e, rowptr, colidx, val_in, X_in.contiguous(), matrix)) return *std::move(out);
#endif
    // torch's call: the half types widened to float32 (torch's half product sums in the half type)
    const bool half = val_in.scalar_type() == at::kHalf || val_in.scalar_type() == at::kBFloat16;
    const at::Tensor val = half ? val_in.to(at::kFloat) : val_in;
    at::Tensor A = at::_sparse_csr_tensor_unsafe(rowptr, colidx, val, {e.out_rows, e.vendor_cols},
                                                 val.options().layout(c10::kSparseCsr));
    at::Tensor X = half ? X_in.to(at::kFloat).contiguous() : X_in.contiguous();
    at::Tensor out = matrix ? at::empty({e.out_rows, e.n}, X.options()) : at::empty({e.out_rows}, X.options());
    if (matrix)
      at::addmm_out(out, out, A, X, /*beta=*/0, /*alpha=*/1);  // beta=0: out is not read
    else
      at::addmv_out(out, out, A, X, /*beta=*/0, /*alpha=*/1);
    return half ? out.to(val_in.scalar_type()) : out;
  }
  const at::Tensor X = aligned(X_in);
  const at::Tensor val = aligned(val_in);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(X.device().index()).stream();
  at::Tensor y = e.op == SDDMM ? at::empty({e.nnz}, X.options())
                 : matrix      ? at::empty({e.out_rows, e.n}, X.options())
                               : at::empty({e.out_rows}, X.options());
  if (e.init_zero) zero_fill(y, stream);
  at::Tensor work;
  if (e.work_numel && e.work_once) {
    std::lock_guard<std::mutex> hold(e.work_lock);
    if (!e.kept_work.defined()) {
      e.kept_work = at::empty({e.work_numel}, X.options().dtype(at::kFloat));
      zero_fill(e.kept_work, stream);
      e.work_stream = stream;
    }
    if (e.work_stream == stream) work = e.kept_work;
  }
  if (e.work_numel && !work.defined()) {
    work = at::empty({e.work_numel}, X.options().dtype(at::kFloat));
    zero_fill(work, stream);
  }
  count(0);
  if (e.grid == 0) return y;
  launch_kernel(e, rowptr, colidx, val, X, y, work, stream);
  return y;
}

// The call served from the registry, or nothing (a miss).
std::optional<at::Tensor> hit(int64_t op, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                              int64_t ncols, const at::Tensor& X) {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> hold(registry_lock);
    // Inside a CUDA graph capture the Python path runs: it keeps what outlives the step out
    // of the graph's private memory pool, and a replay must read the values of its own step.
    if (!registry.empty() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
      e = find(op, crow, col, val, ncols, X);
    }
  }
  if (!e) return young_hit(op, crow, col, val, ncols, X);
  // the values in the transposed order, gathered on every call (Pattern.transposed_values):
  // values are read as they are, and no counter says reliably whether they changed
  if (op == SPMM_T || op == SPMV_T) return serve(*e, crow, col, at::index_select(val, 0, e->perm), X);
  return serve(*e, crow, col, val, X);
}

template <int64_t OP>
at::Tensor product(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val, int64_t ncols,
                   const at::Tensor& X) {
  if (auto out = hit(OP, crow, col, val, ncols, X)) return *std::move(out);
  static auto slow = c10::Dispatcher::singleton()
                         .findSchemaOrThrow((std::string("sparserl_direct::") + kOpNames[OP]).c_str(), "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                           const at::Tensor&)>();
  return slow.call(crow, col, val, ncols, X);
}

// sparserl::sddmm(crow, col, Y, X): the installed kernel from the registry, else the Python
// implementation (sparserl_direct::sddmm), which decides and records (jit/fastpath.py:
// record_sddmm). Only kernels are recorded for it: cuSPARSE's SDDMM stays in Python.
at::Tensor sddmm_product(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& Y, const at::Tensor& X) {
  if (X.dim() == 2) {
    if (auto out = hit(SDDMM, crow, col, Y, X.size(0), X)) return *std::move(out);
  }
  static auto slow = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("sparserl_direct::sddmm", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return slow.call(crow, col, Y, X);
}

}  // namespace
