// Family nnz_split (SDDMM): equal chunks of SR_CHUNK nonzeros per group of SR_LANES lanes
// (aux: part_row, the row holding each chunk's first nonzero). The group walks the rows its
// chunk touches, loading each row of D once; empty rows are stepped over. Perfect balance
// whatever the row lengths; no atomics (each nonzero is in one chunk).
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES == 1, SR_UNROLL, SR_CHUNK.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int part = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (part >= parts) return;  // the whole group leaves together
    const unsigned mask = sr_group_mask();
    const int col0 = gl * SR_VEC;
    const int stop = (int)min((long long)nnz, (long long)(part + 1) * SR_CHUNK);
    int k = (int)((long long)part * SR_CHUNK);
    int row = __ldg(aux + part);
    while (k < stop) {
        const int end = min(__ldg(rowptr + row + 1), stop);
        if (end > k) {
            float d[SR_TB][SR_VEC];
            sr_load_row(d, val + (size_t)row * SR_N, col0);
            sr_row_sample(d, col, x, y, k, end, col0, gl, mask);
            k = end;
        }
        ++row;
    }
}
