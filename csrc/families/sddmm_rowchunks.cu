// Family rowchunks (SDDMM): rows cut into segments of <= SR_SEG nonzeros (aux: seg_row,
// seg_start), SR_LANES lanes per segment. Like group_row, but a hub row is shared by many
// groups, so one row of thousands of nonzeros no longer holds a warp while the others idle.
// No atomics: every output element belongs to one nonzero, hence to one segment.
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES == 1, SR_UNROLL, SR_SEG.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int seg = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (seg >= parts) return;  // the whole group leaves together
    const int row = __ldg(aux + seg);
    const int start = __ldg(aux + parts + seg);
    const int end = min(start + SR_SEG, __ldg(rowptr + row + 1));
    const int col0 = gl * SR_VEC;
    float d[SR_TB][SR_VEC];
    sr_load_row(d, val + (size_t)row * SR_N, col0);
    sr_row_sample(d, col, x, y, start, end, col0, gl, sr_group_mask());
}
