// sparserl: op=spmm dtype=f32 rows=natural split=none block=256 grid=ceil(nnz*n/256) init=zero
// One thread per (nonzero, column) adds its product into y with a NON-atomic read-modify-write:
// threads of the same row lose each other's updates, differently on every run.
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)nnz * n) return;
    int k = (int)(i / n), j = (int)(i % n);
    int lo = 0, hi = rows - 1;  // the row of nonzero k: the last r with rowptr[r] <= k
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (rowptr[mid] <= k) lo = mid; else hi = mid - 1;
    }
    volatile float* out = y + (long long)lo * n + j;
    float old = *out;
    __nanosleep((unsigned)(k * 37) % 512);  // widen the window between the read and the write
    *out = old + val[k] * x[(long long)col[k] * n + j];
}
