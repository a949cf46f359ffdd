// The registry's operators, which Python calls (library.h names them sparserl_fastpath::*):
// install an entry, forget them all, count the live ones, bind the call counters.
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// serving.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

void install(const at::Tensor& crow, const at::Tensor& col, int64_t ncols, int64_t op, int64_t n,
             c10::ScalarType dtype, int64_t nnz, int64_t in_rows, int64_t out_rows,
             const c10::optional<at::Tensor>& rowptr, const c10::optional<at::Tensor>& colidx,
             const c10::optional<at::Tensor>& perm, int64_t launcher, at::IntArrayRef geometry,
             const c10::optional<at::Tensor>& aux, at::IntArrayRef ints, bool init_zero, int64_t work_numel,
             int64_t vendor_cols, int64_t function, bool work_once) {
  TORCH_CHECK(op >= SPMM && op <= SDDMM, "sparserl_fastpath.install: op must be 0..4 (got ", op, ")");
  TORCH_CHECK(op != SDDMM || launcher != 0 || function != 0, "sparserl_fastpath.install: an SDDMM entry needs a "
              "kernel (cuSPARSE's SDDMM is served in Python)");
  TORCH_CHECK(crow.is_cuda() && col.is_cuda() && !crow.is_inference() && !col.is_inference(),
              "sparserl_fastpath.install: crow and col must be CUDA tensors with version counters");
  TORCH_CHECK(geometry.size() == 3 && ints.size() == 5,
              "sparserl_fastpath.install: geometry is (grid, block, smem) and ints (rows, cols, n, nnz, parts)");
  TORCH_CHECK((op == SPMM_T || op == SPMV_T) == (perm.has_value() && perm->defined()),
              "sparserl_fastpath.install: the transposed ops, and only they, take perm");
  TORCH_CHECK(launcher == 0 || function == 0, "sparserl_fastpath.install: a kernel has a C launcher or a driver "
              "function, not both");
  TORCH_CHECK(function == 0 || driver_launch() != nullptr, "sparserl_fastpath.install: this CUDA runtime cannot "
              "look up cuLaunchKernel (CUDA 12.5 or later is needed), so a driver function cannot be served");
  auto e = std::make_shared<Entry>();
  e->crow = weak_of(crow);
  e->col = weak_of(col);
  e->crow_raw = crow.unsafeGetTensorImpl();
  e->col_raw = col.unsafeGetTensorImpl();
  e->crow_version = crow._version();
  e->col_version = col._version();
  e->op = op;
  e->ncols = ncols;
  e->n = n;
  e->dtype = dtype;
  e->nnz = nnz;
  e->in_rows = in_rows;
  e->out_rows = out_rows;
  if (rowptr.has_value()) e->rowptr = *rowptr;
  if (colidx.has_value()) e->colidx = *colidx;
  if (perm.has_value()) e->perm = *perm;
  e->rowptr_version = version_of(e->rowptr);
  e->colidx_version = version_of(e->colidx);
  e->perm_version = version_of(e->perm);
  e->vendor = launcher == 0 && function == 0;
  if (e->vendor) e->plan = std::make_unique<VendorPlan>();
  e->vendor_cols = vendor_cols;
  e->launch = reinterpret_cast<LaunchFn>(static_cast<std::uintptr_t>(launcher));
  e->function = reinterpret_cast<void*>(static_cast<std::uintptr_t>(function));
  e->grid = static_cast<unsigned>(geometry[0]);
  e->block = static_cast<unsigned>(geometry[1]);
  e->smem = static_cast<unsigned>(geometry[2]);
  if (aux.has_value()) e->aux = *aux;
  for (int i = 0; i < 5; ++i) e->ints[i] = static_cast<int>(ints[i]);
  e->init_zero = init_zero;
  e->work_numel = work_numel;
  e->work_once = work_once;
  std::lock_guard<std::mutex> hold(registry_lock);
  std::vector<std::shared_ptr<Entry>> kept;
  kept.reserve(registry.size() + 1);
  for (auto& old : registry) {
    const bool same = old->crow_raw == e->crow_raw && old->col_raw == e->col_raw && old->op == op &&
                      old->ncols == ncols && old->n == n && old->dtype == dtype;
    if (!same && is_alive(old->crow) && is_alive(old->col)) kept.push_back(std::move(old));
  }
  kept.push_back(std::move(e));
  registry.swap(kept);
}

void forget() {
  forget_young();
  std::vector<std::shared_ptr<Entry>> dropped;
  std::lock_guard<std::mutex> hold(registry_lock);
  dropped.swap(registry);
}

int64_t entries() {
  std::lock_guard<std::mutex> hold(registry_lock);
  int64_t live = 0;
  for (const auto& e : registry) live += is_alive(e->crow) && is_alive(e->col);
  return live;
}

void bind_counters(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.numel() == 3 && t.is_contiguous(),
              "sparserl_fastpath.bind_counters: expected 3 contiguous int64 CPU values");
  std::lock_guard<std::mutex> hold(registry_lock);
  counters = t;
}

}  // namespace
