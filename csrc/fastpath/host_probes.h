// Host-cost probes: the host microseconds of a bare launch and of a served call (the benchmarks'
// bare_launch_us, served_us), and of what a served product issues (host_costs_us, for the
// runtime's end-to-end decision).
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// registry_ops.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

// Host microseconds per call of `calls` calls of fn with no synchronization inside: the best of
// five loops, each started on an idle stream, as the benchmarks time a served call's host cost.
template <typename Fn>
double best_loop_us(cudaStream_t stream, int64_t calls, Fn&& fn) {
  double best = 1e300;
  for (int round = 0; round < 5; ++round) {
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto started = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < calls; ++i) fn();
    const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - started;
    best = std::min(best, spent.count() / static_cast<double>(calls));
  }
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return best;
}

// Host microseconds per launch of `calls` bare launches (the best of five loops) of the kernel
// of the entry that serves these operands, into one preallocated output: no lookup, no
// allocation, no zero-fill, no check. The floor that the benchmarks hold a hit's host cost
// against (bench_eager.py).
double bare_launch_us(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val, int64_t ncols,
                      const at::Tensor& X, int64_t op, int64_t calls) {
  TORCH_CHECK(op >= SPMM && op <= SDDMM && calls > 0, "sparserl_fastpath.bare_launch_us: op must be 0..4 and calls "
              "positive (got op ", op, ", calls ", calls, ")");
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> hold(registry_lock);
    e = find(op, crow, col, val, ncols, X);
  }
  TORCH_CHECK(e && !e->vendor && e->grid > 0, "sparserl_fastpath.bare_launch_us: no kernel entry serves these "
              "operands (record them with one product first)");
  c10::cuda::CUDAGuard guard(X.device());
  const at::Tensor& rowptr = e->rowptr.defined() ? e->rowptr : crow;
  const at::Tensor& colidx = e->colidx.defined() ? e->colidx : col;
  const at::Tensor Xa = aligned(X);
  const at::Tensor values = aligned(op == SPMM_T || op == SPMV_T ? at::index_select(val, 0, e->perm) : val);
  const bool matrix = (op == SPMM || op == SPMM_T);
  at::Tensor y = op == SDDMM ? at::empty({e->nnz}, X.options())
                 : matrix    ? at::empty({e->out_rows, e->n}, X.options())
                             : at::empty({e->out_rows}, X.options());
  at::Tensor work = e->work_numel ? at::zeros({e->work_numel}, X.options().dtype(at::kFloat)) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(X.device().index()).stream();
  return best_loop_us(stream, calls, [&] { launch_kernel(*e, rowptr, colidx, values, Xa, y, work, stream); });
}

// Host microseconds per call of `calls` hits served from C++ alone (the best of five loops):
// the registry's lookup, the checks, the output's allocation and free, every launch. Against
// bare_launch_us it says what a hit costs in C++; against a served Python call, what the door
// adds (bench_eager.py).
double served_us(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val, int64_t ncols,
                 const at::Tensor& X, int64_t op, int64_t calls) {
  TORCH_CHECK(op >= SPMM && op <= SDDMM && calls > 0, "sparserl_fastpath.served_us: op must be 0..4 and calls "
              "positive (got op ", op, ", calls ", calls, ")");
  TORCH_CHECK(X.is_cuda(), "sparserl_fastpath.served_us: expected a CUDA operand (got a ", X.device(), " tensor)");
  TORCH_CHECK(hit(op, crow, col, val, ncols, X).has_value(), "sparserl_fastpath.served_us: no entry serves these "
              "operands (record them with one product first)");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(X.device().index()).stream();
  return best_loop_us(stream, calls, [&] { hit(op, crow, col, val, ncols, X); });
}

// Host µs per call of what a served product issues, for the runtime's end-to-end decision (the
// best of three loops of `calls`, on the current stream): [0] an output's allocation, [1] one
// launch (a cudaMemsetAsync: a zero-fill, and the price of a kernel launch), [2] a cuSPARSE SpMV
// and [3] a cuSPARSE SpMM (N=32) through a vendor entry's kept descriptors, allocation included
// (-1 where cuSPARSE is not called directly). Measured on a 256 x 256 diagonal matrix: the
// host's work does not grow with the matrix.
std::vector<double> host_costs_us(const at::Tensor& like, int64_t calls) {
  TORCH_CHECK(like.is_cuda() && calls > 0, "sparserl_fastpath.host_costs_us: expected a CUDA tensor and a positive "
              "number of calls (got a ", like.device(), " tensor, calls ", calls, ")");
  c10::cuda::CUDAGuard guard(like.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  auto per_call = [calls](auto&& fn) {
    double best = 1e300;
    for (int round = 0; round < 3; ++round) {
      const auto started = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < calls; ++i) fn();
      const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - started;
      best = std::min(best, spent.count() / static_cast<double>(calls));
    }
    return best;
  };
  const auto floats = like.options().dtype(at::kFloat);
  std::vector<double> costs(4, -1.0);
  costs[0] = per_call([&] { at::empty({256}, floats); });
  const at::Tensor buffer = at::empty({256}, floats);
  costs[1] = per_call([&] { zero_fill(buffer, stream); });
#if SPARSERL_CUSPARSE
  if (cusparse_api() != nullptr) {
    const auto ints = like.options().dtype(at::kInt);
    const at::Tensor rowptr = at::arange(257, ints), colidx = at::arange(256, ints);
    const at::Tensor val = at::ones({256}, floats), x = at::ones({256}, floats), X = at::ones({256, 32}, floats);
    for (const bool matrix : {false, true}) {
      Entry e;
      e.vendor = true;
      e.plan = std::make_unique<VendorPlan>();
      e.nnz = e.out_rows = e.vendor_cols = e.in_rows = e.ncols = 256;
      e.n = matrix ? 32 : 1;
      if (!cusparse_product(e, rowptr, colidx, val, matrix ? X : x, matrix)) continue;  // refused
      costs[matrix ? 3 : 2] = per_call([&] { cusparse_product(e, rowptr, colidx, val, matrix ? X : x, matrix); });
    }
  }
#endif
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // the entries' workspaces are freed with them
  return costs;
}

}  // namespace
