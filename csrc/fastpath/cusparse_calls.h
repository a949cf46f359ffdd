// cuSPARSE called directly: its functions found in the library torch loaded (Cusparse,
// cusparse_api), the types of a product (VendorTypes), a vendor entry's product through its kept
// descriptors (cusparse_product), and a product with descriptors of its own (cusparse_once).
// Compiled only where cuSPARSE's header is found (SPARSERL_CUSPARSE).
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// young.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

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
// (benchmarks/probes/probe_half_cusparse.py).
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

}  // namespace
