// Family merge_path (SpMV): split=merge(SR_ITEMS); thread p consumes SR_ITEMS items of the merged
// list (row ends ∪ nonzeros) starting at the merge-path coordinate (aux[p], aux[parts+1+p]).
// A row whose end is consumed is stored when the thread also saw its start, else atomically
// added; the unfinished row at the end of the thread's range is atomically added (init=zero).
// Why fast: equal work per thread counting both rows and nonzeros, so it balances hub rows AND
// long runs of empty/short rows (the case nnz_split pays binary searches for); no shuffles.
// Needs: SR_BLOCK, SR_ITEMS.
extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int p = (int)(blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x);
    if (p >= parts) return;
    const int* __restrict__ part_row = aux;
    const int* __restrict__ part_nz = aux + parts + 1;
    const int r0 = __ldg(part_row + p), k0 = __ldg(part_nz + p);
    const int r1 = __ldg(part_row + p + 1), k1 = __ldg(part_nz + p + 1);
    int r = r0, k = k0;
    // rows that started before this thread's range get atomics
    bool shared = r0 < rows && k0 > __ldg(rowptr + r0);
    int row_end = r < rows ? __ldg(rowptr + r + 1) : nnz;
    float sum = 0.f;
    while (r < r1 || k < k1) {
        if (r < rows && k >= row_end) {  // consume the end of row r
            if (shared) sr_atomic(y + r, sum); else sr_st(y + r, sum);
            shared = false;
            sum = 0.f;
            ++r;
            row_end = r < rows ? __ldg(rowptr + r + 1) : nnz;
        } else {                           // consume nonzero k
            sum = fmaf(sr_ld(val + k), sr_ld(x + __ldg(col + k)), sum);
            ++k;
        }
    }
    // the row still open at the end of the range continues in the next thread
    if (r < rows && k > max(k0, __ldg(rowptr + r))) sr_atomic(y + r, sum);
}
