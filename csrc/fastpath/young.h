// Young patterns: the patterns stage_csr made (staging.h), remembered for their admission age
// and served by cuSPARSE meanwhile (young_hit, through cusparse_once of cusparse_calls.h).
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// registry.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

// A pattern stage_csr made, served by cuSPARSE from here until its deadline (its admission age).
struct Young {
  std::optional<ImplPtr> crow, col;  // weak: identity only
  c10::TensorImpl* crow_raw = nullptr;
  c10::TensorImpl* col_raw = nullptr;
  int64_t crow_version = 0, col_version = 0, ncols = 0;
  std::chrono::steady_clock::time_point deadline;
  bool transposed_done = false;  // its first transposed product was served (the next ones go to Python)
};

constexpr size_t kYoungKept = 256;  // young patterns remembered at most (a loader keeps a few alive)
std::mutex young_lock;
std::vector<Young> young;
std::atomic<size_t> young_size{0};

// Remember a pattern stage_csr just made, for `age_ns` nanoseconds. Caller holds no lock.
void remember_young(const at::Tensor& crow, const at::Tensor& col, int64_t ncols, int64_t age_ns) {
  const auto now = std::chrono::steady_clock::now();
  Young y;
  y.crow = weak_of(crow);
  y.col = weak_of(col);
  y.crow_raw = crow.unsafeGetTensorImpl();
  y.col_raw = col.unsafeGetTensorImpl();
  y.crow_version = crow._version();
  y.col_version = col._version();
  y.ncols = ncols;
  y.deadline = now + std::chrono::nanoseconds(age_ns);
  std::lock_guard<std::mutex> hold(young_lock);
  // the dead and the old first; then, past the bound, the oldest
  young.erase(std::remove_if(young.begin(), young.end(),
                             [&](const Young& o) { return o.deadline <= now || !is_alive(o.crow) || !is_alive(o.col); }),
              young.end());
  if (young.size() >= kYoungKept) young.erase(young.begin());
  young.push_back(std::move(y));
  young_size.store(young.size(), std::memory_order_relaxed);
}

void forget_young() {
  std::lock_guard<std::mutex> hold(young_lock);
  young.clear();
  young_size.store(0, std::memory_order_relaxed);
}

#if SPARSERL_CUSPARSE
std::optional<at::Tensor> cusparse_once(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                                        int64_t ncols, const at::Tensor& X_in, bool transposed);
#endif

// The call of a young pattern served by cuSPARSE, or nothing: not a young pattern's (another
// tensor, written since it was staged, past its deadline, another ncols), an op or operands
// cusparse_once does not take, a transposed product after the first, or one under deterministic
// algorithms (cuSPARSE's transposed products may differ in the last bits from run to run).
std::optional<at::Tensor> young_hit(int64_t op, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                                    int64_t ncols, const at::Tensor& X) {
#if SPARSERL_CUSPARSE
  if (young_size.load(std::memory_order_relaxed) == 0 || op == SDDMM) return std::nullopt;
  const bool transposed = op == SPMM_T || op == SPMV_T;
  if (X.dim() != ((op == SPMM || op == SPMM_T) ? 2 : 1) || !X.is_cuda() || crow.is_inference() ||
      col.is_inference() || (transposed && at::globalContext().deterministicAlgorithms()))
    return std::nullopt;
  {
    std::lock_guard<std::mutex> hold(young_lock);
    auto found = std::find_if(young.begin(), young.end(), [&](const Young& y) {
      return y.crow_raw == crow.unsafeGetTensorImpl() && y.col_raw == col.unsafeGetTensorImpl();
    });
    if (found == young.end() || found->ncols != ncols || std::chrono::steady_clock::now() >= found->deadline ||
        !is_alive(found->crow) || !is_alive(found->col) || crow._version() != found->crow_version ||
        col._version() != found->col_version || (transposed && found->transposed_done))
      return std::nullopt;
    if (transposed) found->transposed_done = true;
  }
  auto out = cusparse_once(crow, col, val, ncols, X, transposed);
  if (out) {
    count(1);  // a cuSPARSE call, and a young one: as the runtime counts a young call it leaves to cuSPARSE
    count(2);
  }
  return out;
#else
  return std::nullopt;
#endif
}

}  // namespace
