// The C++ fast path of the sparse products in compiled graphs (torch_sparserl/jit/fastpath.py).
//
// On a small graph a product is bound by the CPU, and its Python implementation (argument
// checks, pattern lookup, the runtime's decision, the launch through ctypes) costs tens of
// microseconds. This library serves the CUDA products in C++, through three doors:
//
//   - the CUDA kernels of `sparserl::{spmm,spmv,spmm_transposed,spmv_transposed}` (eager calls
//     of the operators, under autograd too, and the backward products);
//   - the same for `sparserl_fast::*` (compiled graphs, after AOTAutograd);
//   - `serve()`, a Python function of this module, which an eager `A @ X` on a CSRMatrix calls
//     without the dispatcher (it declines what needs autograd, autocast or a mode).
//
// Every door looks its operands up in a registry that the Python implementation fills after it
// has served the same call itself:
//
//   hit   the same crow and col tensors (identity, alive, unmodified: version counters), the
//         same op, ncols, N and dtype, operands of the recorded sizes  -> the installed kernel is
//         launched from here, through its library's C launcher or, for a kernel the runtime
//         serves from its NVRTC build while that library is built, through the driver's
//         cuLaunchKernel (or cuSPARSE, where the runtime decided no kernel beats it);
//   miss  anything else  -> `sparserl_direct::<op>`, the Python implementation, which checks,
//         raises the operators' errors, decides, and records what served the call (serve()
//         returns None instead: its caller runs the Python path).
//
// Nothing here decides or validates a pattern: an entry only repeats what the Python path did
// for the same operands. The registry is emptied whenever the runtime changes.
//
// Young patterns: a pattern this library staged itself (stage_csr: host arrays checked on their
// private copy), which the runtime leaves to cuSPARSE while it is younger than its admission age
// (jit.admit_age_s), is served here by cuSPARSE on its own arrays (cusparse_once) until that age,
// with no Python: the products of a sampled mini-batch. Its first transposed product too, through
// cuSPARSE's transpose operation, as the Python path would (ops: _transposed_once).
//
// Built by torch.utils.cpp_extension (C++ against the CUDA runtime API: kernels are launched
// through the C launchers of the libraries torch_sparserl.toolchain.inline builds, or as driver
// functions (CUfunction) of NVRTC builds; no CUDA code is compiled here).

#include <Python.h>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_sparse_csr_tensor_unsafe.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/addmv.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#if __has_include(<cusparse.h>)
#include <cusparse.h>
#include <dlfcn.h>
#include <link.h>
#define SPARSERL_CUSPARSE 1
// torch's cuSPARSE handle of the current device, set to the current stream (libtorch_cuda;
// declared here: its header, ATen/cuda/CUDAContextLight.h, needs cuBLAS and cuSOLVER headers too)
namespace at::cuda {
cusparseHandle_t getCurrentCUDASparseHandle();
}
#else  // no cuSPARSE header here: cuSPARSE is reached through at::addmm / at::addmv only
#define SPARSERL_CUSPARSE 0
#endif

#include <cstdint>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

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

// ------------------------------------------------------------------ young patterns

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

#if SPARSERL_CUSPARSE
// The cuSPARSE functions of the library torch loaded (found among the process's loaded objects,
// so that no second copy is loaded and nothing is linked); null where it is not found.
struct Cusparse {
  decltype(&cusparseCreateCsr) create_csr;
  decltype(&cusparseCsrSetPointers) csr_set;
  decltype(&cusparseDestroySpMat) destroy_sp;
  decltype(&cusparseCreateDnMat) create_dnmat;
  decltype(&cusparseDnMatSetValues) dnmat_set;
  decltype(&cusparseDestroyDnMat) destroy_dnmat;
  decltype(&cusparseCreateDnVec) create_dnvec;
  decltype(&cusparseDnVecSetValues) dnvec_set;
  decltype(&cusparseDestroyDnVec) destroy_dnvec;
  decltype(&cusparseSpMV_bufferSize) spmv_size;
  decltype(&cusparseSpMV) spmv;
  decltype(&cusparseSpMV_preprocess) spmv_preprocess;  // optional (cuSPARSE 12.4+): null where missing
  decltype(&cusparseSpMM_bufferSize) spmm_size;
  decltype(&cusparseSpMM) spmm;
};

const Cusparse* cusparse_api() {
  static const Cusparse* api = []() -> const Cusparse* {
    std::string path;
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* found) {
          if (info->dlpi_name && std::strstr(info->dlpi_name, "libcusparse.so")) {
            *static_cast<std::string*>(found) = info->dlpi_name;
            return 1;
          }
          return 0;
        },
        &path);
    if (path.empty()) return nullptr;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    static Cusparse fns;
    bool ok = true;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && fn != nullptr;
    };
    get(fns.create_csr, "cusparseCreateCsr");
    get(fns.csr_set, "cusparseCsrSetPointers");
    get(fns.destroy_sp, "cusparseDestroySpMat");
    get(fns.create_dnmat, "cusparseCreateDnMat");
    get(fns.dnmat_set, "cusparseDnMatSetValues");
    get(fns.destroy_dnmat, "cusparseDestroyDnMat");
    get(fns.create_dnvec, "cusparseCreateDnVec");
    get(fns.dnvec_set, "cusparseDnVecSetValues");
    get(fns.destroy_dnvec, "cusparseDestroyDnVec");
    get(fns.spmv_size, "cusparseSpMV_bufferSize");
    get(fns.spmv, "cusparseSpMV");
    get(fns.spmm_size, "cusparseSpMM_bufferSize");
    get(fns.spmm, "cusparseSpMM");
    fns.spmv_preprocess = reinterpret_cast<decltype(fns.spmv_preprocess)>(dlsym(lib, "cusparseSpMV_preprocess"));
    return ok ? &fns : nullptr;
  }();
  return api;
}

VendorPlan::~VendorPlan() {
  const Cusparse* api = cusparse_api();
  if (api == nullptr) return;
  if (A) api->destroy_sp(A);
  if (X) api->destroy_dnmat(X);
  if (Y) api->destroy_dnmat(Y);
  if (x) api->destroy_dnvec(x);
  if (y) api->destroy_dnvec(y);
}

// The cuSPARSE types of a product whose values and operand are `scalar`: the data type, and
// the type it computes in, with alpha and beta of that type. The half types compute in float32,
// so that their sums are float32 sums, rounded once (torch's own half products through cuSPARSE
// sum in the half type); nothing for a type the vendor path does not take.
//
// A bfloat16 SpMM writes float32, narrowed once afterwards (`wide_out`): with a bfloat16 output
// cuSPARSE's SpMM sums a row of 4096 ones to 4768 under its default and CSR_ALG2 algorithms
// (their partial sums meet in the output's type; CSR_ALG1 and ALG3 are exact but 1.5-6x slower),
// while with a float32 output every algorithm is exact and the product itself no slower; the
// operands stay bfloat16, so the gather of X keeps its half width. A float16 output is exact
// (benchmarks/probe_half_cusparse.py).
struct VendorTypes {
  cudaDataType data, compute;
  const void* one;
  const void* zero;
  bool wide_spmm_out() const { return data == CUDA_R_16BF; }
};
std::optional<VendorTypes> vendor_types(at::ScalarType scalar) {
  static const float one32 = 1.0f, zero32 = 0.0f;
  static const double one64 = 1.0, zero64 = 0.0;
  switch (scalar) {
    case at::kFloat: return VendorTypes{CUDA_R_32F, CUDA_R_32F, &one32, &zero32};
    case at::kDouble: return VendorTypes{CUDA_R_64F, CUDA_R_64F, &one64, &zero64};
    case at::kHalf: return VendorTypes{CUDA_R_16F, CUDA_R_32F, &one32, &zero32};
    case at::kBFloat16: return VendorTypes{CUDA_R_16BF, CUDA_R_32F, &one32, &zero32};
    default: return std::nullopt;
  }
}

// Whether new vendor entries preprocess their SpMV (benchmarks turn it off to measure it).
std::atomic<bool> spmv_preprocess_on{true};

// out = A @ X by cuSPARSE through the entry's kept descriptors; nothing where this cannot be
// done (no cuSPARSE found, a dtype or index type it is not set up for, an empty product, a
// refusal), and the caller then goes through at::addmm / at::addmv.
std::optional<at::Tensor> cusparse_product(Entry& e, const at::Tensor& rowptr, const at::Tensor& colidx,
                                           const at::Tensor& val, const at::Tensor& X, bool matrix) {
  const Cusparse* api = cusparse_api();
  if (api == nullptr || !e.plan || e.nnz == 0 || e.out_rows == 0 || e.vendor_cols == 0 || (matrix && e.n == 0))
    return std::nullopt;
  const std::optional<VendorTypes> types = vendor_types(val.scalar_type());
  if (!types) return std::nullopt;
  const cudaDataType dt = types->data, compute = types->compute;
  if (rowptr.scalar_type() != colidx.scalar_type() || !rowptr.is_contiguous() || !colidx.is_contiguous() ||
      !val.is_contiguous())
    return std::nullopt;
  const cusparseIndexType_t index = rowptr.scalar_type() == at::kInt ? CUSPARSE_INDEX_32I : CUSPARSE_INDEX_64I;
  VendorPlan& p = *e.plan;
  std::lock_guard<std::mutex> hold(p.lock);
  if (p.failed) return std::nullopt;
  const bool wide_out = matrix && types->wide_spmm_out();
  const cudaDataType out_dt = wide_out ? CUDA_R_32F : dt;
  at::Tensor out = matrix ? at::empty({e.out_rows, e.n}, X.options().dtype(wide_out ? at::kFloat : X.scalar_type()))
                          : at::empty({e.out_rows}, X.options());
  const void* alpha = types->one;
  const void* beta = types->zero;
  cusparseHandle_t handle = at::cuda::getCurrentCUDASparseHandle();  // on the current stream
  bool ok = true;
  auto check = [&](cusparseStatus_t status) { ok = ok && status == CUSPARSE_STATUS_SUCCESS; };
  if (p.A == nullptr)
    check(api->create_csr(&p.A, e.out_rows, e.vendor_cols, e.nnz, rowptr.data_ptr(), colidx.data_ptr(),
                          val.data_ptr(), index, index, CUSPARSE_INDEX_BASE_ZERO, dt));
  else
    check(api->csr_set(p.A, rowptr.data_ptr(), colidx.data_ptr(), val.data_ptr()));
  if (matrix) {
    if (ok && p.X == nullptr) {
      check(api->create_dnmat(&p.X, X.size(0), e.n, e.n, X.data_ptr(), dt, CUSPARSE_ORDER_ROW));
      check(api->create_dnmat(&p.Y, e.out_rows, e.n, e.n, out.data_ptr(), out_dt, CUSPARSE_ORDER_ROW));
    } else if (ok) {
      check(api->dnmat_set(p.X, X.data_ptr()));
      check(api->dnmat_set(p.Y, out.data_ptr()));
    }
    if (ok && !p.sized) {
      check(api->spmm_size(handle, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, p.A,
                           p.X, beta, p.Y, compute, CUSPARSE_SPMM_ALG_DEFAULT, &p.buffer_bytes));
      p.sized = ok;
    }
  } else {
    if (ok && p.x == nullptr) {
      check(api->create_dnvec(&p.x, X.size(0), X.data_ptr(), dt));
      check(api->create_dnvec(&p.y, e.out_rows, out.data_ptr(), dt));
    } else if (ok) {
      check(api->dnvec_set(p.x, X.data_ptr()));
      check(api->dnvec_set(p.y, out.data_ptr()));
    }
    if (ok && !p.sized) {
      check(api->spmv_size(handle, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, p.A, p.x, beta, p.y, compute,
                           CUSPARSE_SPMV_ALG_DEFAULT, &p.buffer_bytes));
      p.sized = ok;
    }
  }
  if (!ok) {
    p.failed = true;
    return std::nullopt;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(X.device().index()).stream();
  // asked only where a preprocessed workspace is or may be involved (SpMV), not on every call
  auto capturing = [] { return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None; };
  if (!matrix && !p.preprocessed && p.stream == nullptr && api->spmv_preprocess != nullptr &&
      spmv_preprocess_on.load() && !capturing()) {
    p.stream = stream;  // tried once, on this stream
    p.workspace = at::empty({static_cast<int64_t>(std::max<size_t>(p.buffer_bytes, 1))}, X.options().dtype(at::kByte));
    p.preprocessed = api->spmv_preprocess(handle, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, p.A, p.x, beta, p.y, compute,
                                          CUSPARSE_SPMV_ALG_DEFAULT, p.workspace.data_ptr()) == CUSPARSE_STATUS_SUCCESS;
    if (!p.preprocessed) p.workspace = at::Tensor();  // plain calls with a workspace of their own
  }
  if (p.preprocessed && (stream != p.stream || capturing())) return std::nullopt;  // not this workspace's stream
  // else the workspace comes from torch's caching allocator on the current stream, every call
  at::Tensor buffer = p.preprocessed ? p.workspace
                                     : at::empty({static_cast<int64_t>(std::max<size_t>(p.buffer_bytes, 1))},
                                                 X.options().dtype(at::kByte));
  if (matrix)
    check(api->spmm(handle, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, p.A, p.X, beta,
                    p.Y, compute, CUSPARSE_SPMM_ALG_DEFAULT, buffer.data_ptr()));
  else
    check(api->spmv(handle, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, p.A, p.x, beta, p.y, compute,
                    CUSPARSE_SPMV_ALG_DEFAULT, buffer.data_ptr()));
  if (!ok) {
    p.failed = true;
    return std::nullopt;
  }
  return wide_out ? out.to(X.scalar_type()) : out;
}
// A @ X, or Aᵀ @ X (opA = transpose), by cuSPARSE on A's own CSR arrays, with descriptors made
// for this call: the products of a pattern met once (a sampled mini-batch's, torch_sparserl/ops:
// _vendor_once and _transposed_once), without the sparse tensor, the Python path and the
// registry entry a recorded pattern has, and for a transposed one without its transpose.
// Nothing where cuSPARSE cannot do it here (not found, a dtype or index type it is not set up
// for, an empty product, a refusal, graph capture): the caller then takes its Python path.
// cuSPARSE's transposed products may differ in the last bits from run to run; the caller does
// not ask for them under deterministic mode.
std::optional<at::Tensor> cusparse_once(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                                        int64_t ncols, const at::Tensor& X_in, bool transposed) {
  const Cusparse* api = cusparse_api();
  const bool matrix = X_in.dim() == 2;
  if (api == nullptr || !X_in.is_cuda() || (X_in.dim() != 1 && !matrix) || !crow.is_cuda() || !col.is_cuda() ||
      !val.is_cuda() || crow.dim() != 1 || col.dim() != 1 || val.dim() != 1 || crow.device() != X_in.device() ||
      col.device() != X_in.device() || val.device() != X_in.device() || crow.scalar_type() != col.scalar_type() ||
      val.scalar_type() != X_in.scalar_type() || !crow.is_contiguous() || !col.is_contiguous() ||
      !val.is_contiguous())
    return std::nullopt;
  const std::optional<VendorTypes> types = vendor_types(val.scalar_type());
  if (!types) return std::nullopt;
  const cudaDataType dt = types->data, compute = types->compute;
  if (crow.scalar_type() != at::kInt && crow.scalar_type() != at::kLong) return std::nullopt;
  const int64_t rows = crow.size(0) - 1, nnz = col.size(0), n = matrix ? X_in.size(1) : 1;
  const int64_t in_rows = transposed ? rows : ncols, out_rows = transposed ? ncols : rows;
  if (rows <= 0 || ncols <= 0 || nnz == 0 || n == 0 || val.size(0) != nnz || X_in.size(0) != in_rows)
    return std::nullopt;
  const cusparseOperation_t opA = transposed ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return std::nullopt;
  c10::cuda::CUDAGuard guard(X_in.device());
  const at::Tensor X = X_in.contiguous();
  const bool wide_out = matrix && types->wide_spmm_out();  // see VendorTypes
  at::Tensor out = matrix ? at::empty({out_rows, n}, X.options().dtype(wide_out ? at::kFloat : X.scalar_type()))
                          : at::empty({out_rows}, X.options());
  const cusparseIndexType_t index = crow.scalar_type() == at::kInt ? CUSPARSE_INDEX_32I : CUSPARSE_INDEX_64I;
  const void* alpha = types->one;
  const void* beta = types->zero;
  cusparseHandle_t handle = at::cuda::getCurrentCUDASparseHandle();  // on the current stream
  // descriptors of this call, destroyed on every way out
  struct Descriptors {
    const Cusparse* api;
    cusparseSpMatDescr_t A = nullptr;
    cusparseDnMatDescr_t B = nullptr, C = nullptr;
    cusparseDnVecDescr_t x = nullptr, y = nullptr;
    ~Descriptors() {
      if (A) api->destroy_sp(A);
      if (B) api->destroy_dnmat(B);
      if (C) api->destroy_dnmat(C);
      if (x) api->destroy_dnvec(x);
      if (y) api->destroy_dnvec(y);
    }
  } d{api};
  bool ok = true;
  auto check = [&](cusparseStatus_t status) { ok = ok && status == CUSPARSE_STATUS_SUCCESS; };
  check(api->create_csr(&d.A, rows, ncols, nnz, crow.data_ptr(), col.data_ptr(), val.data_ptr(), index, index,
                        CUSPARSE_INDEX_BASE_ZERO, dt));
  size_t bytes = 0;
  if (matrix) {
    if (ok) check(api->create_dnmat(&d.B, in_rows, n, n, X.data_ptr(), dt, CUSPARSE_ORDER_ROW));
    if (ok) check(api->create_dnmat(&d.C, out_rows, n, n, out.data_ptr(), wide_out ? CUDA_R_32F : dt,
                                    CUSPARSE_ORDER_ROW));
    if (ok)
      check(api->spmm_size(handle, opA, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, d.A, d.B, beta, d.C, compute,
                           CUSPARSE_SPMM_ALG_DEFAULT, &bytes));
  } else {
    if (ok) check(api->create_dnvec(&d.x, in_rows, X.data_ptr(), dt));
    if (ok) check(api->create_dnvec(&d.y, out_rows, out.data_ptr(), dt));
    if (ok) check(api->spmv_size(handle, opA, alpha, d.A, d.x, beta, d.y, compute, CUSPARSE_SPMV_ALG_DEFAULT, &bytes));
  }
  if (!ok) return std::nullopt;
  const at::Tensor buffer = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, X.options().dtype(at::kByte));
  if (matrix)
    check(api->spmm(handle, opA, CUSPARSE_OPERATION_NON_TRANSPOSE, alpha, d.A, d.B, beta, d.C, compute,
                    CUSPARSE_SPMM_ALG_DEFAULT, buffer.data_ptr()));
  else
    check(api->spmv(handle, opA, alpha, d.A, d.x, beta, d.y, compute, CUSPARSE_SPMV_ALG_DEFAULT, buffer.data_ptr()));
  if (!ok) return std::nullopt;
  return wide_out ? out.to(X.scalar_type()) : out;
}
#endif


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

// ------------------------------------------------------------------ the registry's operators

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

// fn(begin, end) over [0, total): in one call where total is below 2 * grain, else in chunks of
// at least `grain` on the calling thread and torch's inter-op pool, returning once all are done.
// (at::parallel_for would run serially here: its OpenMP pragmas are compiled into this library,
// which is built without -fopenmp.) fn must not throw. Returns the chunks' length (the last may
// be shorter): chunk c is [c * length, (c + 1) * length).
template <typename F>
int64_t across_threads(int64_t total, int64_t grain, const F& fn) {
  const int64_t chunks =
      std::min<int64_t>(total / grain, std::max<int64_t>(1, static_cast<int64_t>(at::get_num_interop_threads())));
  if (chunks < 2) {
    fn(0, total);
    return std::max<int64_t>(total, 1);
  }
  const int64_t length = (total + chunks - 1) / chunks;
  int64_t pending = chunks - 1;  // under `mutex`: the last task touches nothing of this frame after it
  std::mutex mutex;
  std::condition_variable finished;
  for (int64_t c = 1; c < chunks; ++c)
    at::launch([&, c] {
      fn(c * length, std::min(total, (c + 1) * length));
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) finished.notify_one();
    });
  fn(0, length);
  std::unique_lock<std::mutex> lock(mutex);
  finished.wait(lock, [&] { return pending == 0; });
  return length;
}

// Copies a host CSR's indices into `out` (crow at 0, col at `offset`) and checks the copy: row
// pointers from 0 to nnz without a decrease, columns in [0, ncols). The check reads the copy, so
// what passed is what travels, whatever the caller writes meanwhile. Blocks of `block` elements
// are copied, then checked while they are in cache (one pass over main memory, as a plain copy
// makes); large arrays are split over threads (across_threads), and the row pairs that straddle
// two blocks are checked once every block is copied. The loops carry no dependency from one
// element to the next, so the compiler vectorizes them.
template <typename I>
bool copy_checked(const I* crow, const I* col, I* out, int64_t rows, int64_t nnz, int64_t offset, int64_t ncols) {
  using U = std::make_unsigned_t<I>;
  constexpr int64_t block = 8192, grain = int64_t{1} << 17;  // elements; below 2 * grain, one thread
  const U limit = static_cast<U>(ncols);  // ncols fits I: the caller refuses int32 indices past 2^31 - 1
  std::atomic<bool> bad{false};
  const int64_t length = across_threads(offset + nnz, grain, [&](int64_t begin, int64_t end) {
    I decreases = 0;
    U outside = 0;  // a negative column is a large unsigned one
    for (int64_t first = begin; first < end; first += block) {
      const int64_t last = std::min(end, first + block), split = std::clamp(offset, first, last);
      if (split > first) {  // [first, split): row pointers, and the pairs inside the block
        std::memcpy(out + first, crow + first, static_cast<size_t>(split - first) * sizeof(I));
        for (int64_t i = first; i + 1 < split; ++i) decreases |= static_cast<I>(out[i + 1] < out[i]);
      }
      if (last > split) {  // [split, last): columns
        std::memcpy(out + split, col + (split - offset), static_cast<size_t>(last - split) * sizeof(I));
        for (int64_t k = split; k < last; ++k) outside |= static_cast<U>(static_cast<U>(out[k]) >= limit);
      }
    }
    if (decreases != 0 || outside != 0) bad.store(true, std::memory_order_relaxed);
  });
  bool ok = !bad.load() && out[0] == 0 && static_cast<int64_t>(out[rows]) == nnz;
  // the pairs (first - 1, first) of every block starting inside the row pointers
  for (int64_t start = 0; ok && start <= rows; start += length)
    for (int64_t first = start; ok && first < std::min(start + length, rows + 1); first += block)
      if (first > 0) ok = out[first] >= out[first - 1];
  return ok;
}

// Host CSR arrays bound for a CUDA device (ts.csr of a sampled mini-batch): every check of
// ts.csr's Python path on its metadata (dims, dtypes, lengths against the shape, int32 bounds),
// the indices copied into one pinned buffer and checked there (copy_checked), then sent to two
// device tensors of their own (views of one buffer would alias: AOTAutograd hands aliased graph
// inputs over as views it makes, which the pattern cache does not know). The values, when given,
// are copied to pinned memory and sent the same way: no later write to the caller's arrays
// reaches the device. Nothing (an empty list) where this does not apply or a check fails: the
// caller's Python path then converts, copies, checks and names what is wrong. young_ns > 0: the
// pattern is young for that long (remember_young).
std::vector<at::Tensor> stage_csr(const at::Tensor& crow_in, const at::Tensor& col_in,
                                  const std::optional<at::Tensor>& val_in, int64_t nrows, int64_t ncols,
                                  at::Device device, int64_t young_ns) {
  const auto index = crow_in.scalar_type();
  if (!device.is_cuda() || !crow_in.device().is_cpu() || !col_in.device().is_cpu() || crow_in.dim() != 1 ||
      col_in.dim() != 1 || col_in.scalar_type() != index || (index != at::kInt && index != at::kLong) ||
      nrows < 0 || ncols < 0 || crow_in.size(0) != nrows + 1 || crow_in.requires_grad() || col_in.requires_grad() ||
      crow_in.is_inference() || col_in.is_inference())
    return {};
  const int64_t nnz = col_in.size(0), int32_max = std::numeric_limits<int32_t>::max();
  if (index == at::kInt && (nrows > int32_max || ncols > int32_max || nnz > int32_max)) return {};
  if (val_in && (!val_in->device().is_cpu() || val_in->dim() != 1 || val_in->size(0) != nnz ||
                 val_in->requires_grad() || !at::isFloatingType(val_in->scalar_type())))
    return {};
  const at::Tensor crow = crow_in.contiguous(), col = col_in.contiguous();  // a copy only where strided
  const int64_t offset = nrows + 1;
  at::Tensor staged = at::empty({offset + nnz}, crow.options().pinned_memory(true));
  const bool ok = index == at::kInt
                      ? copy_checked(crow.data_ptr<int32_t>(), col.data_ptr<int32_t>(), staged.data_ptr<int32_t>(),
                                     nrows, nnz, offset, ncols)
                      : copy_checked(crow.data_ptr<int64_t>(), col.data_ptr<int64_t>(), staged.data_ptr<int64_t>(),
                                     nrows, nnz, offset, ncols);
  if (!ok) return {};
  at::Tensor crow_out = at::empty({offset}, crow.options().device(device));
  at::Tensor col_out = at::empty({nnz}, col.options().device(device));
  // torch's host allocator keeps `staged` until both copies are done
  crow_out.copy_(staged.narrow(0, 0, offset), /*non_blocking=*/true);
  col_out.copy_(staged.narrow(0, offset, nnz), /*non_blocking=*/true);
  std::vector<at::Tensor> out{crow_out, col_out};
  // young: served by cuSPARSE from here for young_ns (the runtime's admission age), unless it has
  // more nonzeros than positions (cuSPARSE refuses those; Python multiplies their dense form)
  if (young_ns > 0 && static_cast<__int128>(nnz) <= static_cast<__int128>(nrows) * ncols)
    remember_young(crow_out, col_out, ncols, young_ns);
  if (val_in) {
    at::Tensor values = at::empty({nnz}, val_in->options().pinned_memory(true));
    values.copy_(*val_in);
    at::Tensor moved = at::empty({nnz}, values.options().device(device));
    moved.copy_(values, /*non_blocking=*/true);
    out.push_back(moved);
  }
  return out;
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

// ------------------------------------------------------------------ the eager door

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

PyMethodDef methods[] = {
    {"serve", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&py_serve)), METH_FASTCALL,
     "serve(op, crow, col, val, ncols, X) -> Tensor | None: an eager CSRMatrix product from the registry"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "sparserl_fastpath", nullptr, -1, methods};

}  // namespace

#define SPARSERL_CONCAT_(a, b) a##b
#define SPARSERL_CONCAT(a, b) SPARSERL_CONCAT_(a, b)

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
