// sparserl: op=spmv dtype=f32 rows=natural split=none block=128 grid=ceil(rows/128) work=rows
// Correct output, but it writes one element past the end of its workspace.
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    for (int k = rowptr[r]; k < rowptr[r + 1]; ++k) work[r] += val[k] * x[col[k]];
    y[r] = work[r];
    if (r == 0) work[rows] = 1.f;
}
