// Family sell (SpMV): rows=sell(SR_C,SR_SIGMA); one thread per row, SR_C rows per slice stored
// column-major (entry k of lane t at slice_ptr[s] + k*C + t), so the sell_col/sell_nz loads of a
// warp are perfectly coalesced and there is no reduction. Sorting inside windows of SIGMA rows
// keeps the padding small. Why fast: regular patterns (FEM, stencils, banded, road networks)
// where rows in a window have similar length: ELL-like streaming with ~no padding.
// Needs: SR_BLOCK, SR_C, SR_UNROLL.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int slot = (int)(blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x);
    if (slot >= rows) return;
    const int s = slot / SR_C;
    const int t = slot % SR_C;
    const int* __restrict__ slice_ptr = aux;
    const int* __restrict__ perm = aux + parts + 1;
    const int P = __ldg(slice_ptr + parts);
    const int* __restrict__ sell_col = perm + rows;
    const int* __restrict__ sell_nz = sell_col + P;
    const int begin = __ldg(slice_ptr + s) + t;
    const int end = __ldg(slice_ptr + s + 1);
    float sum = 0.f;
    int i = begin;
    for (; i + (SR_UNROLL - 1) * SR_C < end; i += SR_UNROLL * SR_C) {
        int c[SR_UNROLL], z[SR_UNROLL];
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) {
            c[u] = __ldg(sell_col + i + u * SR_C);
            z[u] = __ldg(sell_nz + i + u * SR_C);
        }
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u)
            if (z[u] >= 0) sum = fmaf(sr_ld(val + z[u]), sr_ld(x + c[u]), sum);
    }
#if SR_UNROLL > 1
    for (; i < end; i += SR_C) {
        const int z = __ldg(sell_nz + i);
        if (z >= 0) sum = fmaf(sr_ld(val + z), sr_ld(x + __ldg(sell_col + i)), sum);
    }
#endif
    sr_st(y + __ldg(perm + slot), sum);
}
