// Family warp_row_staged (SpMM): SR_LANES (8/16/32) lanes per row; the group loads a batch of
// (col, val) pairs coalesced - one pair per lane - and every lane then reads them back:
// SR_STAGE_SMEM 0: broadcast from registers with __shfl_sync (batch = SR_LANES pairs);
// SR_STAGE_SMEM 1: through a per-group shared-memory buffer (batch = 32 pairs, padded rows).
// All groups of a warp loop to the warp's longest row so the shuffles/__syncwarp see all lanes.
// Why fast: long rows (social graphs, citation, FEM with 50-500 nonzeros per row) stop paying
// one col/val load per nonzero per lane; the loads of X stay vectorized and independent.
// Optional: SR_EPILOGUE (spmm_common.cuh).
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES, SR_SORTED, SR_STAGE_SMEM.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts SR_EPILOGUE_PARAMS)
{
    const int slot = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    // A warp whose groups are all past the end leaves as a whole; the others keep every lane.
    const int warp_first = (int)((blockIdx.x * (unsigned)SR_BLOCK + (threadIdx.x & ~31u)) / SR_LANES);
    if (warp_first >= rows) return;
    int row = -1, start = 0, len = 0;
    if (slot < rows) {
#if SR_SORTED
        row = __ldg(aux + slot);
#else
        row = slot;
#endif
        start = __ldg(rowptr + row);
        len = __ldg(rowptr + row + 1) - start;
    }
    const int maxlen = __reduce_max_sync(SR_FULL, len);
#if SR_STAGE_SMEM
    __shared__ int s_col[SR_BLOCK / SR_LANES][33];
    __shared__ float s_val[SR_BLOCK / SR_LANES][33];
    const int g = threadIdx.x / SR_LANES;
#endif
#pragma unroll 1
    for (int pass = 0; pass < SR_PASSES; ++pass) {
        const int col0 = pass * SR_TB * SR_W + gl * SR_VEC;
        float acc[SR_TB][SR_VEC];
        sr_acc_zero(acc);
#if SR_STAGE_SMEM
        for (int base = 0; base < maxlen; base += 32) {
#pragma unroll
            for (int i = gl; i < 32; i += SR_LANES) {
                int c = 0;
                float v = 0.f;
                if (base + i < len) { c = __ldg(col + start + base + i); v = sr_ld(val + start + base + i); }
                s_col[g][i] = c;
                s_val[g][i] = v;
            }
            __syncwarp();
            const int cnt = min(32, len - base);  // may be <= 0 for short rows of this warp
#pragma unroll 4
            for (int jj = 0; jj < cnt; ++jj)
                sr_axpy(acc, s_val[g][jj], x + (size_t)s_col[g][jj] * SR_N, col0);
            __syncwarp();  // the buffer is rewritten by the next batch
        }
#else
        for (int base = 0; base < maxlen; base += SR_LANES) {
            int c = 0;
            float v = 0.f;
            if (base + gl < len) { c = __ldg(col + start + base + gl); v = sr_ld(val + start + base + gl); }
#pragma unroll
            for (int jj = 0; jj < SR_LANES; ++jj) {
                const int cj = __shfl_sync(SR_FULL, c, jj, SR_LANES);
                const float vj = __shfl_sync(SR_FULL, v, jj, SR_LANES);
                if (base + jj < len) sr_axpy(acc, vj, x + (size_t)cj * SR_N, col0);
            }
        }
#endif
#if SR_EPILOGUE
        if (row >= 0) sr_epilogue(acc, row, col0, sr_bias, sr_scale);
#endif
        if (row >= 0) sr_flush(y, row, col0, acc, false);
    }
}
