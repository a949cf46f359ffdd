// sparserl: op=spmm dtype=f32 rows=natural split=none block=256 grid=ceil(rows*n/256)
// Never returns: spins on a value it reads from memory (the compiler cannot remove the loop).
extern "C" __global__ void sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const float* __restrict__ val,
    const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    volatile const int* first = rowptr;
    while (*first >= 0) { }
    y[0] = 0.f;
}
