// Family rowchunks (SpMM): split=rowchunks(SR_SEG); every row is cut into segments of at most
// SR_SEG nonzeros (an empty row is one empty segment), one segment per group of SR_LANES lanes
// (group_row inside a segment). Single-segment rows are stored; a multi-segment (hub) row's
// pieces are added in float32 to its workspace slot (work=hubs*SR_HUB: SR_N sums, then the slot's
// counter), and the group adding the last piece stores the row and zeroes the slot
// (work_init=once). Every row of y is stored once: no zero-fill, one launch per call.
// Why fast: group_row speed on the ordinary rows, while a hub row is spread over len/SR_SEG
// groups instead of serializing one warp (power-law graphs, arrow matrices).
// Needs: SR_BLOCK, SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES, SR_UNROLL, SR_SEG.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int seg = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int gl = threadIdx.x % SR_LANES;
    if (seg >= parts) return;  // a whole group returns: its lanes share seg
    const int row = __ldg(aux + seg);
    const int start = __ldg(aux + parts + seg);
    const int rbeg = __ldg(rowptr + row), rend = __ldg(rowptr + row + 1);
    const int end = min(start + SR_SEG, rend);
    const bool whole = start == rbeg && end == rend;
    float* hub = work + (size_t)(whole ? 0 : __ldg(aux + 2 * parts + seg)) * SR_HUB;
#pragma unroll 1
    for (int pass = 0; pass < SR_PASSES; ++pass) {
        const int col0 = pass * SR_TB * SR_W + gl * SR_VEC;
        float acc[SR_TB][SR_VEC];
        sr_acc_zero(acc);
        sr_row_accumulate(acc, col, val, x, start, end, col0);
        if (whole) sr_flush(y, row, col0, acc, false);
        else sr_hub_add(hub, col0, acc);
    }
    if (!whole && sr_hub_last<SR_LANES>(reinterpret_cast<int*>(hub + SR_HUB - 4), (rend - rbeg + SR_SEG - 1) / SR_SEG))
        sr_store_hub(y, row, gl, hub);
}
