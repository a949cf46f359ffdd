// Family rowchunks (SpMV): split=rowchunks(SR_SEG); SR_LANES lanes per segment of at most SR_SEG
// nonzeros of one row (an empty row is one empty segment), reduced with shuffles. Single-segment
// rows are stored; a hub row's pieces are added in float32 to its workspace slot (work=hubs*2:
// the sum, then a counter), and the group adding the last piece stores the row and zeroes the
// slot (work_init=once). Every row of y is stored once: no zero-fill, one launch per call.
// Why fast: vector_row on ordinary rows with hubs cut into equal pieces, so one 10^5-nonzero row
// no longer decides the runtime (power-law, arrow).
// Needs: SR_BLOCK, SR_LANES, SR_UNROLL, SR_SEG.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int seg = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int lane = threadIdx.x % SR_LANES;
    // No early return: every lane reaches the shuffles below.
    int row = -1, start = 0, end = 0;
    bool whole = true;
    if (seg < parts) {
        row = __ldg(aux + seg);
        start = __ldg(aux + parts + seg);
        const int rbeg = __ldg(rowptr + row), rend = __ldg(rowptr + row + 1);
        end = min(start + SR_SEG, rend);
        whole = start == rbeg && end == rend;
    }
    float sum = 0.f;
    int j = start + lane;
    for (; j + (SR_UNROLL - 1) * SR_LANES < end; j += SR_UNROLL * SR_LANES) {
        int c[SR_UNROLL];
        float v[SR_UNROLL];
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) {
            c[u] = __ldg(col + j + u * SR_LANES);
            v[u] = sr_ld(val + j + u * SR_LANES);
        }
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) sum = fmaf(v[u], sr_ld(x + c[u]), sum);
    }
#if SR_UNROLL > 1
    for (; j < end; j += SR_LANES) sum = fmaf(sr_ld(val + j), sr_ld(x + __ldg(col + j)), sum);
#endif
#if SR_LANES > 1
    sum = sr_group_sum<SR_LANES>(sum);
#endif
    if (row >= 0 && !whole) {  // a whole group: its lanes share seg
        float* hub = work + 2 * (size_t)__ldg(aux + 2 * parts + seg);
        if (lane == 0) atomicAdd(hub, sum);
        const int rlen = __ldg(rowptr + row + 1) - __ldg(rowptr + row);
        if (sr_hub_last<SR_LANES>(reinterpret_cast<int*>(hub + 1), (rlen + SR_SEG - 1) / SR_SEG) && lane == 0) {
            sr_st(y + row, __ldcg(hub));
            __stcg(hub, 0.f);  // zero for the next launch
        }
        return;
    }
    if (row >= 0 && lane == 0) sr_st(y + row, sum);
}
