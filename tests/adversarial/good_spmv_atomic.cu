// sparserl: op=spmv dtype=f32 rows=natural split=none block=256 grid=ceil(nnz/256) init=zero
// A correct kernel whose sums are nondeterministic in their last bits: one thread per nonzero,
// atomicAdd into the zero-filled y. The evaluator must accept rounding-level differences.
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= nnz) return;
    int lo = 0, hi = rows - 1;  // the row of nonzero k: the last r with rowptr[r] <= k
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (rowptr[mid] <= k) lo = mid; else hi = mid - 1;
    }
    atomicAdd(&y[lo], val[k] * x[col[k]]);
}
