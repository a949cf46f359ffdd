// sparserl: op=spmm dtype=f32 rows=natural split=none block=256 grid=ceil(rows*n/256)
// Computes on its first launch only; later launches return at once and write nothing
// (a "cached result" that is not there). Blocks count finished blocks: during launch 1 the
// count stays below gridDim.x, so every block of launch 1 computes.
__device__ unsigned int finished_blocks = 0;
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    if (atomicAdd(&finished_blocks, 0) >= gridDim.x) return;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)rows * n;
    if (i < total) {
        int r = (int)(i / n), j = (int)(i % n);
        float acc = 0.f;
        for (int k = rowptr[r]; k < rowptr[r + 1]; ++k) acc += val[k] * x[(long long)col[k] * n + j];
        y[i] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&finished_blocks, 1);
}
