// sparserl: op=spmm dtype=f32 n=32 rows=natural split=none block=1024 grid=ceil(rows/32)
// Correct code, but with no launch bounds it keeps ~200 values live per thread: 1024 threads
// × that many registers exceed the 65536 registers of an SM, so no block can launch.
#define N 32
#define PARTIALS 160
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    int r = blockIdx.x * 32 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows) return;
    float acc[PARTIALS];
#pragma unroll
    for (int p = 0; p < PARTIALS; ++p) acc[p] = 0.f;
    int begin = rowptr[r], end = rowptr[r + 1];
    for (int k = begin; k < end; ++k) {
        float v = val[k] * x[(long long)col[k] * N + lane];
#pragma unroll
        for (int p = 0; p < PARTIALS; ++p) acc[p] = fmaf(acc[p], 0.999f + 0.0001f * p, (p == (k - begin) % PARTIALS) ? v : 0.f);
    }
    float sum = 0.f;
#pragma unroll
    for (int p = 0; p < PARTIALS; ++p) sum += acc[p];
    y[(long long)r * N + lane] = sum;
}
