// cuSPARSE SpMM on half data: which algorithm and output type sum in float32, at what time.
// Run through benchmarks/probes/probe_half_cusparse.py, which writes the pattern files it reads.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cusparse.h>
#define CK(x) do { auto e = (x); if (e != 0) { printf("err %d at %d\n", (int)e, __LINE__); exit(1);} } while (0)
template <class T> std::vector<T> rd(const char* f, size_t n) {
  std::vector<T> v(n);
  FILE* fp = fopen(f, "rb");
  if (!fp || fread(v.data(), sizeof(T), n, fp) != n) { printf("cannot read %s\n", f); exit(1); }
  fclose(fp);
  return v;
}
__global__ void fill_half(__half* p, size_t n, unsigned seed, int ones) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) { float r = ((i * 2654435761u + seed) % 2001) / 1000.0f - 1.0f; p[i] = __float2half(ones ? 1.0f : r); } }
__global__ void fill_bf(__nv_bfloat16* p, size_t n, unsigned seed, int ones) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) { float r = ((i * 2654435761u + seed) % 2001) / 1000.0f - 1.0f; p[i] = __float2bfloat16(ones ? 1.0f : r); } }
__global__ void to_f32_h(const __half* a, float* b, size_t n) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) b[i] = __half2float(a[i]); }
__global__ void to_f32_b(const __nv_bfloat16* a, float* b, size_t n) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) b[i] = __bfloat162float(a[i]); }
int main(int argc, char** argv) {
  int N = atoi(argv[1]);
  std::string dir = argv[2];
  auto meta = rd<long long>((dir + "/meta.bin").c_str(), 3);
  int rows = meta[0], cols = meta[1], nnz = meta[2];
  auto ptr = rd<int>((dir + "/indptr.bin").c_str(), rows + 1); auto idx = rd<int>((dir + "/indices.bin").c_str(), nnz);
  int *dptr, *didx; CK(cudaMalloc(&dptr, 4 * (rows + 1))); CK(cudaMalloc(&didx, 4 * (size_t)nnz));
  CK(cudaMemcpy(dptr, ptr.data(), 4 * (rows + 1), cudaMemcpyHostToDevice)); CK(cudaMemcpy(didx, idx.data(), 4 * (size_t)nnz, cudaMemcpyHostToDevice));
  cusparseHandle_t h; CK(cusparseCreate(&h));
  const char* algname[] = {"DEFAULT", "CSR_ALG1", "CSR_ALG2", "CSR_ALG3"};
  cusparseSpMMAlg_t algs[] = {CUSPARSE_SPMM_ALG_DEFAULT, CUSPARSE_SPMM_CSR_ALG1, CUSPARSE_SPMM_CSR_ALG2, CUSPARSE_SPMM_CSR_ALG3};
  float one = 1, zero = 0;
  for (int bf = 0; bf < 2; ++bf) {
    cudaDataType dt = bf ? CUDA_R_16BF : CUDA_R_16F;
    void *val, *X, *val1, *X1; size_t xs = (size_t)cols * N;
    CK(cudaMalloc(&val, 2 * (size_t)nnz)); CK(cudaMalloc(&X, 2 * xs)); CK(cudaMalloc(&val1, 2 * (size_t)nnz)); CK(cudaMalloc(&X1, 2 * xs));
    int tb = 256;
    if (bf) { fill_bf<<<(nnz + tb - 1) / tb, tb>>>((__nv_bfloat16*)val, nnz, 1, 0); fill_bf<<<(xs + tb - 1) / tb, tb>>>((__nv_bfloat16*)X, xs, 7, 0);
              fill_bf<<<(nnz + tb - 1) / tb, tb>>>((__nv_bfloat16*)val1, nnz, 1, 1); fill_bf<<<(xs + tb - 1) / tb, tb>>>((__nv_bfloat16*)X1, xs, 7, 1); }
    else { fill_half<<<(nnz + tb - 1) / tb, tb>>>((__half*)val, nnz, 1, 0); fill_half<<<(xs + tb - 1) / tb, tb>>>((__half*)X, xs, 7, 0);
           fill_half<<<(nnz + tb - 1) / tb, tb>>>((__half*)val1, nnz, 1, 1); fill_half<<<(xs + tb - 1) / tb, tb>>>((__half*)X1, xs, 7, 1); }
    // the float32 reference: values and X widened, all-float32 SpMM
    float *vf, *Xf, *Yref; CK(cudaMalloc(&vf, 4 * (size_t)nnz)); CK(cudaMalloc(&Xf, 4 * xs)); CK(cudaMalloc(&Yref, 4 * (size_t)rows * N));
    if (bf) { to_f32_b<<<(nnz + tb - 1) / tb, tb>>>((__nv_bfloat16*)val, vf, nnz); to_f32_b<<<(xs + tb - 1) / tb, tb>>>((__nv_bfloat16*)X, Xf, xs); }
    else { to_f32_h<<<(nnz + tb - 1) / tb, tb>>>((__half*)val, vf, nnz); to_f32_h<<<(xs + tb - 1) / tb, tb>>>((__half*)X, Xf, xs); }
    cusparseSpMatDescr_t Af; cusparseDnMatDescr_t Bf, Cf; size_t bytes;
    CK(cusparseCreateCsr(&Af, rows, cols, nnz, dptr, didx, vf, CUSPARSE_INDEX_32I, CUSPARSE_INDEX_32I, CUSPARSE_INDEX_BASE_ZERO, CUDA_R_32F));
    CK(cusparseCreateDnMat(&Bf, cols, N, N, Xf, CUDA_R_32F, CUSPARSE_ORDER_ROW)); CK(cusparseCreateDnMat(&Cf, rows, N, N, Yref, CUDA_R_32F, CUSPARSE_ORDER_ROW));
    CK(cusparseSpMM_bufferSize(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, Af, Bf, &zero, Cf, CUDA_R_32F, CUSPARSE_SPMM_ALG_DEFAULT, &bytes));
    void* bufr; CK(cudaMalloc(&bufr, bytes + 1));
    CK(cusparseSpMM(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, Af, Bf, &zero, Cf, CUDA_R_32F, CUSPARSE_SPMM_ALG_DEFAULT, bufr));
    std::vector<float> ref((size_t)rows * N); CK(cudaMemcpy(ref.data(), Yref, 4 * ref.size(), cudaMemcpyDeviceToHost));
    for (int wide = 0; wide < 2; ++wide) for (int a = 0; a < 4; ++a) {
      cudaDataType ct = wide ? CUDA_R_32F : dt; size_t osz = wide ? 4 : 2;
      void* Y; CK(cudaMalloc(&Y, osz * (size_t)rows * N));
      double err = -1, onesval = -1, us = -1;
      for (int ones = 0; ones < 2; ++ones) {
        cusparseSpMatDescr_t A; cusparseDnMatDescr_t B, C;
        CK(cusparseCreateCsr(&A, rows, cols, nnz, dptr, didx, ones ? val1 : val, CUSPARSE_INDEX_32I, CUSPARSE_INDEX_32I, CUSPARSE_INDEX_BASE_ZERO, dt));
        CK(cusparseCreateDnMat(&B, cols, N, N, ones ? X1 : X, dt, CUSPARSE_ORDER_ROW)); CK(cusparseCreateDnMat(&C, rows, N, N, Y, ct, CUSPARSE_ORDER_ROW));
        size_t b2 = 0; auto st = cusparseSpMM_bufferSize(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A, B, &zero, C, CUDA_R_32F, algs[a], &b2);
        if (st != 0) { printf("%s %s out=%s: bufferSize refused (%d)\n", bf ? "bf16" : "f16", algname[a], wide ? "f32" : "half", (int)st); break; }
        void* buf; CK(cudaMalloc(&buf, b2 + 1));
        if (a == 3) { st = cusparseSpMM_preprocess(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A, B, &zero, C, CUDA_R_32F, algs[a], buf); }
        st = cusparseSpMM(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A, B, &zero, C, CUDA_R_32F, algs[a], buf);
        if (st != 0) { printf("%s %s out=%s: refused (%d)\n", bf ? "bf16" : "f16", algname[a], wide ? "f32" : "half", (int)st); break; }
        CK(cudaDeviceSynchronize());
        std::vector<float> got((size_t)rows * N);
        if (wide) CK(cudaMemcpy(got.data(), Y, 4 * got.size(), cudaMemcpyDeviceToHost));
        else { float* t; CK(cudaMalloc(&t, 4 * got.size())); if (bf) to_f32_b<<<(got.size() + tb - 1) / tb, tb>>>((__nv_bfloat16*)Y, t, got.size()); else to_f32_h<<<(got.size() + tb - 1) / tb, tb>>>((__half*)Y, t, got.size()); CK(cudaMemcpy(got.data(), t, 4 * got.size(), cudaMemcpyDeviceToHost)); cudaFree(t); }
        if (ones) onesval = got[0];
        else {
          double num = 0, den = 0; for (size_t i = 0; i < got.size(); ++i) { double d = got[i] - ref[i]; num += d * d; den += (double)ref[i] * ref[i]; } err = sqrt(num / den);
          cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
          for (int w = 0; w < 5; ++w) cusparseSpMM(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A, B, &zero, C, CUDA_R_32F, algs[a], buf);
          cudaEventRecord(e0); for (int w = 0; w < 30; ++w) cusparseSpMM(h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A, B, &zero, C, CUDA_R_32F, algs[a], buf);
          cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); us = ms * 1000 / 30;
        }
        cudaFree(buf); cusparseDestroySpMat(A); cusparseDestroyDnMat(B); cusparseDestroyDnMat(C);
      }
      if (err >= 0) printf("%s N=%d %-8s out=%-4s  %8.1f us  rel_err %.2e  row_of_4096_ones %.0f\n", bf ? "bf16" : "f16", N, algname[a], wide ? "f32" : "half", us, err, onesval);
      cudaFree(Y);
    }
  }
  return 0;
}
