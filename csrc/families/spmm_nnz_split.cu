// Family nnz_split (SpMM): split=nnz(SR_CHUNK); a group of SR_LANES lanes takes the SR_CHUNK
// nonzeros [g*C, (g+1)*C), walks their rows in order and accumulates SR_VEC columns per lane per
// tile in registers. A row wholly inside the chunk is stored; a row shared with a neighbouring
// chunk is atomically added (float4/float2 atomics on sm_90, half2 atomics), init=zero covers
// empty rows. Why fast: every group does the same work whatever the skew (arrow matrices with a
// 46500-nonzero row, R-MAT / web hubs), while short-row stretches still flush with plain stores.
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES, SR_UNROLL, SR_CHUNK.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int chunk = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (chunk >= parts) return;  // no shuffles in this kernel
    const int cstart = chunk * SR_CHUNK;
    const int cend = min(cstart + SR_CHUNK, nnz);
    const int rfirst = __ldg(aux + chunk);  // rowptr[rfirst] <= cstart < rowptr[rfirst + 1]
#pragma unroll 1
    for (int pass = 0; pass < SR_PASSES; ++pass) {
        const int col0 = pass * SR_TB * SR_W + gl * SR_VEC;
        int r = rfirst;
        int rbeg = __ldg(rowptr + r), rend = __ldg(rowptr + r + 1);
        int k = cstart;
        while (k < cend) {
            while (rend <= k) { ++r; rbeg = rend; rend = __ldg(rowptr + r + 1); }  // skip empty rows
            const int seg_end = min(rend, cend);
            float acc[SR_TB][SR_VEC];
            sr_acc_zero(acc);
            sr_row_accumulate(acc, col, val, x, k, seg_end, col0);
            sr_flush(y, r, col0, acc, !(rbeg >= cstart && rend <= cend));
            k = seg_end;
        }
    }
}
