// sparserl: op=spmm dtype=f32 rows=natural split=none block=256 grid=ceil(rows*n/256)
// Writes to an address far outside any allocation: an illegal address, a sticky CUDA error
// that poisons the whole context (the sandbox must replace its worker).
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)rows * n;
    if (i >= total) return;
    int r = (int)(i / n), j = (int)(i % n);
    float acc = 0.f;
    for (int k = rowptr[r]; k < rowptr[r + 1]; ++k) acc += val[k] * x[(long long)col[k] * n + j];
    y[i] = acc;
    if (i == 0) {
        // Flip a high address bit: 64 TiB away from y, unmapped.
        float* wild = reinterpret_cast<float*>(reinterpret_cast<unsigned long long>(y) ^ (1ull << 46));
        *wild = acc;
    }
}
