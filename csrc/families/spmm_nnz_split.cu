// Family nnz_split (SpMM): split=nnz(SR_CHUNK); a group of SR_LANES lanes takes the SR_CHUNK
// nonzeros [g*C, (g+1)*C), walks their rows in order and accumulates SR_VEC columns per lane per
// tile in registers. A row wholly inside the chunk is stored; a row shared with a neighbouring
// chunk (only a chunk's first and last rows can be) is atomically added (float4/float2 atomics on
// sm_90), init=zero covers empty rows. For the half types a shared row's pieces are added in
// float32 to its workspace slot instead (work=hubs*SR_HUB, the slot of row r at aux[parts+1+r]),
// and the group adding the row's last piece stores it, rounded once (sr_hub_last).
// Why fast: every group does the same work whatever the skew (arrow matrices with a
// 46500-nonzero row, R-MAT / web hubs), while short-row stretches still flush with plain stores.
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES, SR_UNROLL, SR_CHUNK.
#if SR_DTYPE != 0
// Row r's float32 slot has a piece from every chunk the row meets: the group adding the last
// one stores the row. The group's lanes must be converged.
__device__ __forceinline__ void sr_shared_row_done(T* __restrict__ y, const int* __restrict__ rowptr,
                                                   const int* __restrict__ aux, float* work, int parts, int r,
                                                   int gl) {
    const int rbeg = __ldg(rowptr + r), rend = __ldg(rowptr + r + 1);
    float* hub = work + (size_t)__ldg(aux + parts + 1 + r) * SR_HUB;
    if (sr_hub_last<SR_LANES>(reinterpret_cast<int*>(hub + SR_HUB - 4), (rend - 1) / SR_CHUNK - rbeg / SR_CHUNK + 1))
        sr_store_hub(y, r, gl, hub);
}
#endif
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int chunk = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (chunk >= parts) return;  // a whole group returns: its lanes share chunk
    const int cstart = chunk * SR_CHUNK;
    const int cend = min(cstart + SR_CHUNK, nnz);
    const int rfirst = __ldg(aux + chunk);  // rowptr[rfirst] <= cstart < rowptr[rfirst + 1]
#if SR_DTYPE != 0
    int shared_first = -1, shared_last = -1;  // the chunk's first and last rows, if other chunks hold pieces
#endif
#pragma unroll 1
    for (int pass = 0; pass < SR_PASSES; ++pass) {
        const int col0 = pass * SR_TB * SR_W + gl * SR_VEC;
        int r = rfirst;
        int rbeg = __ldg(rowptr + r), rend = __ldg(rowptr + r + 1);
        int k = cstart;
        while (k < cend) {
            while (rend <= k) { ++r; rbeg = rend; rend = __ldg(rowptr + r + 1); }  // skip empty rows
            const int seg_end = min(rend, cend);
            const bool whole = rbeg >= cstart && rend <= cend;
            float acc[SR_TB][SR_VEC];
            sr_acc_zero(acc);
            sr_row_accumulate(acc, col, val, x, k, seg_end, col0);
#if SR_DTYPE != 0
            if (!whole) {
                sr_hub_add(work + (size_t)__ldg(aux + parts + 1 + r) * SR_HUB, col0, acc);
                if (k == cstart) shared_first = r;
                else shared_last = r;  // a shared row that does not start the chunk ends it
                k = seg_end;
                continue;
            }
#endif
            sr_flush(y, r, col0, acc, !whole);
            k = seg_end;
        }
    }
#if SR_DTYPE != 0
    // group-uniform: the lanes walked the same rows
    if (shared_first >= 0) sr_shared_row_done(y, rowptr, aux, work, parts, shared_first, gl);
    if (shared_last >= 0) sr_shared_row_done(y, rowptr, aux, work, parts, shared_last, gl);
#endif
}
