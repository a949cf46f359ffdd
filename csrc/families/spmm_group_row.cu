// Family group_row (SpMM): SR_LANES lanes per row (32/SR_LANES rows per warp), each lane owns
// SR_VEC consecutive columns (float2/float4, half2x2/x4 loads) of every SR_LANES*SR_VEC-wide
// column tile; all lanes of a row read the same col/val (one broadcast transaction).
// Why fast: the X row gather is one fully used 64-512 byte segment per nonzero; matching the
// tile width to N (e.g. 8 lanes x float4 for N=32) packs several short rows per warp, which is
// what road networks, meshes and banded matrices need. Sorted rows make warps uniform.
// Optional: SR_EPILOGUE (spmm_common.cuh).
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES, SR_UNROLL, SR_SORTED.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts SR_EPILOGUE_PARAMS)
{
    const int slot = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (slot >= rows) return;  // no shuffles in this kernel
#if SR_SORTED
    const int row = __ldg(aux + slot);
#else
    const int row = slot;
#endif
    const int start = __ldg(rowptr + row), end = __ldg(rowptr + row + 1);
#pragma unroll 1
    for (int pass = 0; pass < SR_PASSES; ++pass) {
        const int col0 = pass * SR_TB * SR_W + gl * SR_VEC;
        float acc[SR_TB][SR_VEC];
        sr_acc_zero(acc);
        sr_row_accumulate(acc, col, val, x, start, end, col0);
#if SR_EPILOGUE
        sr_epilogue(acc, row, col0, sr_bias, sr_scale);
#endif
        sr_flush(y, row, col0, acc, false);
    }
}
