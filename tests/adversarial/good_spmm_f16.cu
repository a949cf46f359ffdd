// sparserl: op=spmm dtype=f16 rows=natural split=none block=256 grid=ceil(rows*n/256)
// A correct half-precision kernel: fp16 values and x, sums in fp32, one thread per output.
#include <cuda_fp16.h>
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const __half* __restrict__ val,
    const __half* __restrict__ x, __half* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * n) return;
    int r = (int)(i / n), j = (int)(i % n);
    float acc = 0.f;
    for (int k = rowptr[r]; k < rowptr[r + 1]; ++k)
        acc += __half2float(val[k]) * __half2float(x[(long long)col[k] * n + j]);
    y[i] = __float2half_rn(acc);
}
