// Family group_row (SDDMM): SR_LANES lanes per row (32/SR_LANES rows per warp). The group loads
// its row of D once into registers, SR_VEC consecutive columns per lane, then walks the row's
// nonzeros: one coalesced SR_LANES*SR_VEC-wide gather of X per nonzero, a dot product, a
// shuffle sum. Why fast: D is read once per row instead of once per nonzero (the reference
// gathers both operands per nonzero); narrow groups pack several short rows per warp, and
// sorted rows keep the groups of a warp at similar lengths.
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES == 1, SR_UNROLL, SR_SORTED.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int slot = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (slot >= rows) return;  // the whole group leaves: its shuffles name only its own lanes
#if SR_SORTED
    const int row = __ldg(aux + slot);
#else
    const int row = slot;
#endif
    const int start = __ldg(rowptr + row), end = __ldg(rowptr + row + 1);
    if (start == end) return;
    const int col0 = gl * SR_VEC;
    float d[SR_TB][SR_VEC];
    sr_load_row(d, val + (size_t)row * SR_N, col0);
    sr_row_sample(d, col, x, y, start, end, col0, gl, sr_group_mask());
}
