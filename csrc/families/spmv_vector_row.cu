// Family vector_row (SpMV): SR_LANES lanes per row, SR_BLOCK/SR_LANES rows per block.
// Why fast: matches lanes to the row length, so short-row matrices (roads, FEM, meshes) keep
// every lane busy with no reduction across idle lanes, and long rows get 16-32 lanes that load
// col/val coalesced. SR_UNROLL independent gathers of x per lane hide latency. SR_SORTED makes
// the rows of a warp similar in length (perm by descending length), which removes divergence on
// irregular patterns at the cost of scattered y writes.
// Needs: SR_BLOCK, SR_LANES (1..32, power of two), SR_UNROLL, SR_SORTED.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int slot = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) / SR_LANES);
    const int lane = threadIdx.x % SR_LANES;
    // No early return: every lane reaches the shuffles below (groups past the end do no work).
    int row = -1, start = 0, end = 0;
    if (slot < rows) {
#if SR_SORTED
        row = __ldg(aux + slot);
#else
        row = slot;
#endif
        start = __ldg(rowptr + row);
        end = __ldg(rowptr + row + 1);
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
    if (row >= 0 && lane == 0) sr_st(y + row, sum);
}
