// The registry of recorded products: what an entry holds (Entry; VendorPlan, the cuSPARSE
// descriptors a vendor entry keeps, whose calls are in cusparse_calls.h), the registry with its
// counters, the driver's cuLaunchKernel, and the lookup of the entry that serves a call (find).
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it first,
// after the headers: it is not compiled on its own.

#pragma once

namespace {

using LaunchFn = int (*)(unsigned grid, unsigned block, unsigned smem, void* stream, void** params);
// cuLaunchKernel's signature (cuda.h), with CUfunction and CUstream as the pointers they are
using DriverLaunchFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned smem, void* stream, void** params, void** extra);
using ImplPtr = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// SDDMM: out[k] = dot(Y[row(k)], X[col(k)]), Y in the val slot (rows x n), out one value per nonzero
enum Op : int64_t { SPMM = 0, SPMV = 1, SPMM_T = 2, SPMV_T = 3, SDDMM = 4 };
constexpr const char* kOpNames[] = {"spmm", "spmv", "spmm_transposed", "spmv_transposed", "sddmm"};

// cuSPARSE called directly for a vendor entry: its descriptors made once and kept, so a call
// only points them at its operands (at::addmm / at::addmv make, size and free them every call).
struct VendorPlan {
  std::mutex lock;  // the descriptors are pointed at one call's operands at a time
  bool failed = false;  // cuSPARSE refused it once: at::addmm / at::addmv serve from then on
#if SPARSERL_CUSPARSE
  cusparseSpMatDescr_t A = nullptr;
  cusparseDnMatDescr_t X = nullptr, Y = nullptr;  // spmm
  cusparseDnVecDescr_t x = nullptr, y = nullptr;  // spmv
  size_t buffer_bytes = 0;
  bool sized = false;
  // SpMV preprocessed once (cusparseSpMV_preprocess: the row partition, kept in the workspace):
  // the workspace is then the entry's own, used on the stream it was made on, and calls on
  // another stream or under graph capture go through at::addmv instead
  at::Tensor workspace;
  cudaStream_t stream = nullptr;
  bool preprocessed = false;
  ~VendorPlan();
#endif
};

struct Entry {
  // what the call must look like
  std::optional<ImplPtr> crow, col;  // weak: an entry never keeps the user's adjacency alive
  c10::TensorImpl* crow_raw = nullptr;
  c10::TensorImpl* col_raw = nullptr;
  int64_t crow_version = 0, col_version = 0;
  int64_t op = SPMM, ncols = 0, n = 0, nnz = 0, in_rows = 0, out_rows = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  // what serves it
  at::Tensor rowptr, colidx;  // the validated indices to read when not the call's own (a private copy, int32 copies, the transpose)
  at::Tensor perm;            // transposed ops: val_t = val[perm]
  // their versions at install: the transpose's tensors are handed out (A.t()), and a write to
  // them makes the Python path compute the transpose again, so the entry no longer serves
  int64_t rowptr_version = 0, colidx_version = 0, perm_version = 0;
  bool vendor = false;        // cuSPARSE: directly (plan), else through at::addmm / at::addmv
  std::unique_ptr<VendorPlan> plan;
  int64_t vendor_cols = 0;    // columns of the matrix cuSPARSE multiplies
  LaunchFn launch = nullptr;
  void* function = nullptr;  // a CUfunction, launched with cuLaunchKernel, where launch is null
  unsigned grid = 0, block = 0, smem = 0;
  at::Tensor aux;
  int ints[5] = {0, 0, 0, 0, 0};  // rows cols n nnz parts, as the kernel ABI passes them
  bool init_zero = false;
  int64_t work_numel = 0;
  // work_init=once: the workspace is zeroed when made and every launch leaves it zero, so one is
  // kept, on the stream it was made on (calls on another stream zero a fresh one)
  bool work_once = false;
  std::mutex work_lock;
  at::Tensor kept_work;
  cudaStream_t work_stream = nullptr;
};

std::mutex registry_lock;
std::vector<std::shared_ptr<Entry>> registry;
at::Tensor counters;  // int64 (3,), CPU: calls served by a kernel, by cuSPARSE, and of those young patterns' (read by Python)

ImplPtr weak_of(const at::Tensor& t) { return ImplPtr(t.getIntrusivePtr()); }

// The driver's cuLaunchKernel, looked up once through the runtime (no link against libcuda);
// null where this CUDA runtime cannot say.
DriverLaunchFn driver_launch() {
  static const DriverLaunchFn fn = [] {
    void* found = nullptr;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12050
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernel", &found, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      found = nullptr;
#endif
    return reinterpret_cast<DriverLaunchFn>(found);
  }();
  return fn;
}

bool is_alive(const std::optional<ImplPtr>& p) { return p.has_value() && !p->expired(); }

// A tensor the entry holds is as it was at install (undefined ones and inference tensors, which
// cannot be written outside inference mode, count as intact).
bool held_intact(const at::Tensor& t, int64_t version) {
  return !t.defined() || t.is_inference() || t._version() == version;
}

int64_t version_of(const at::Tensor& t) { return t.defined() && !t.is_inference() ? t._version() : 0; }

void count(int which) {
  if (counters.defined()) __atomic_fetch_add(counters.data_ptr<int64_t>() + which, 1, __ATOMIC_RELAXED);
}

// The entry serving this call, or null. Caller holds registry_lock.
std::shared_ptr<Entry> find(int64_t op, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                            int64_t ncols, const at::Tensor& X) {
  if (!X.is_cuda() || crow.is_inference() || col.is_inference()) return nullptr;
  const bool sddmm = op == SDDMM;  // val is Y there: (rows, n)
  const bool matrix = (op == SPMM || op == SPMM_T || sddmm);
  if (X.dim() != (matrix ? 2 : 1) || val.dim() != (sddmm ? 2 : 1) || X.layout() != c10::kStrided ||
      val.layout() != c10::kStrided)
    return nullptr;
  const int64_t n = matrix ? X.size(1) : 1;
  for (const auto& e : registry) {
    if (e->crow_raw != crow.unsafeGetTensorImpl() || e->col_raw != col.unsafeGetTensorImpl() || e->op != op ||
        e->ncols != ncols || e->n != n || e->dtype != val.scalar_type())
      continue;
    // A weak pointer keeps the TensorImpl's memory, so a live entry's address is never reused
    // by another tensor; expired: the tensor died (its entry is swept at the next install).
    if (!is_alive(e->crow) || !is_alive(e->col)) return nullptr;
    if (crow._version() != e->crow_version || col._version() != e->col_version) return nullptr;
    if (!held_intact(e->rowptr, e->rowptr_version) || !held_intact(e->colidx, e->colidx_version) ||
        !held_intact(e->perm, e->perm_version))
      return nullptr;
    if ((sddmm ? (val.size(0) != e->out_rows || val.size(1) != n) : val.size(0) != e->nnz) ||
        X.size(0) != e->in_rows || X.scalar_type() != e->dtype || !val.is_cuda() || val.device() != X.device() ||
        crow.device() != X.device())
      return nullptr;
    return e;
  }
  return nullptr;
}

}  // namespace
