// sparserl: op=spmm dtype=f32 n=32 rows=natural split=none block=256 grid=ceil(rows/8)
// Correct, but register-starved: __launch_bounds__(256, 8) caps it at 32 registers per thread
// while each warp keeps a 64-float accumulator per lane live across the row loop, so ptxas
// spills to local memory. One warp per row, each lane owns one of the n = 32 columns and
// additionally accumulates 64 partial sums that are folded at the end.
#define N 32
#define PARTIALS 64
extern "C" __global__ void __launch_bounds__(256, 8) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    int r = blockIdx.x * 8 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows) return;
    float acc[PARTIALS];
#pragma unroll
    for (int p = 0; p < PARTIALS; ++p) acc[p] = 0.f;
    int begin = rowptr[r], end = rowptr[r + 1];
    for (int k = begin; k < end; ++k) {
        float v = val[k] * x[(long long)col[k] * N + lane];
#pragma unroll
        for (int p = 0; p < PARTIALS; ++p) acc[p] += (p == (k - begin) % PARTIALS) ? v : 0.f;
    }
    float sum = 0.f;
#pragma unroll
    for (int p = 0; p < PARTIALS; ++p) sum += acc[p];
    y[(long long)r * N + lane] = sum;
}
