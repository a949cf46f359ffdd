// Family binned (SpMV): rows=binned(e1..ek); bin b (rows with e_b <= len < e_{b+1}) is served with
// SR_LANES_b lanes per row (1 = thread per row for short rows, 2..32 = vector per row,
// SR_BLOCK = a whole block per row for hubs), all in ONE persistent launch: the virtual block
// ranges of the bins are computed from aux bin_start, and the grid strides over them.
// Why fast: mixed patterns (power-law / web graphs with many short rows and a few hub rows of
// 10^3-10^5 nonzeros) get the right vector width per row class instead of one compromise width,
// without atomics or init.
// Needs: SR_BLOCK, SR_NBINS (k+1), SR_LANES_0..SR_LANES_8, SR_UNROLL.

// Lanes lane..lane+V*i of one row: partial dot product (not yet reduced over the lanes).
template <int V>
__device__ __forceinline__ float sr_row_partial(const int* __restrict__ col, const T* __restrict__ val,
                                                const T* __restrict__ x, int start, int end, int lane) {
    float sum = 0.f;
    int j = start + lane;
    for (; j + (SR_UNROLL - 1) * V < end; j += SR_UNROLL * V) {
        int c[SR_UNROLL];
        float v[SR_UNROLL];
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) {
            c[u] = __ldg(col + j + u * V);
            v[u] = sr_ld(val + j + u * V);
        }
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) sum = fmaf(v[u], sr_ld(x + c[u]), sum);
    }
    for (; j < end; j += V) sum = fmaf(sr_ld(val + j), sr_ld(x + __ldg(col + j)), sum);
    return sum;
}

// Virtual block `local` of a bin whose rows are perm[lo..hi). Called by every thread of the block.
template <int V>
__device__ __forceinline__ void sr_bin_rows(const int* __restrict__ rowptr, const int* __restrict__ col,
                                            const T* __restrict__ val, const T* __restrict__ x,
                                            T* __restrict__ y, const int* __restrict__ perm,
                                            int lo, int hi, int local) {
    if constexpr (V <= 32) {
        const int slot = lo + local * (SR_BLOCK / V) + (int)threadIdx.x / V;
        const int lane = threadIdx.x % V;
        int row = -1, start = 0, end = 0;
        if (slot < hi) {
            row = __ldg(perm + slot);
            start = __ldg(rowptr + row);
            end = __ldg(rowptr + row + 1);
        }
        float sum = sr_row_partial<V>(col, val, x, start, end, lane);
        if constexpr (V > 1) sum = sr_group_sum<V>(sum);  // all lanes of the warp get here
        if (row >= 0 && lane == 0) sr_st(y + row, sum);
    } else {  // V == SR_BLOCK: one block per row, block-wide reduction
        __shared__ float red[SR_BLOCK / 32];
        const int row = __ldg(perm + lo + local);  // local < hi - lo by construction
        const int start = __ldg(rowptr + row), end = __ldg(rowptr + row + 1);
        float sum = sr_row_partial<SR_BLOCK>(col, val, x, start, end, threadIdx.x);
        sum = sr_group_sum<32>(sum);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
        __syncthreads();
        if (threadIdx.x < 32) {
            float s = threadIdx.x < SR_BLOCK / 32 ? red[threadIdx.x] : 0.f;
            s = sr_group_sum<32>(s);
            if (threadIdx.x == 0) sr_st(y + row, s);
        }
        __syncthreads();  // red is reused by the next virtual block
    }
}

extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    const int lanes[9] = {SR_LANES_0, SR_LANES_1, SR_LANES_2, SR_LANES_3, SR_LANES_4,
                          SR_LANES_5, SR_LANES_6, SR_LANES_7, SR_LANES_8};
    const int* __restrict__ bin_start = aux;
    const int* __restrict__ perm = aux + SR_NBINS + 1;
    // vs[b] = first virtual block of bin b (only these stay in registers; bin_start is re-read)
    int vs[SR_NBINS + 1];
    vs[0] = 0;
    int prev = __ldg(bin_start);
#pragma unroll
    for (int b = 0; b < SR_NBINS; ++b) {
        const int next = __ldg(bin_start + b + 1);
        const int per = SR_BLOCK / lanes[b];  // rows per virtual block
        vs[b + 1] = vs[b] + (next - prev + per - 1) / per;
        prev = next;
    }
    for (int v = blockIdx.x; v < vs[SR_NBINS]; v += gridDim.x) {  // block-uniform loop
        int b = 0, first = 0;
#pragma unroll
        for (int i = 1; i < SR_NBINS; ++i)
            if (v >= vs[i]) { b = i; first = vs[i]; }
        const int lo = __ldg(bin_start + b), hi = __ldg(bin_start + b + 1);
        const int local = v - first;
        switch (b) {
        case 0: sr_bin_rows<SR_LANES_0>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#if SR_NBINS > 1
        case 1: sr_bin_rows<SR_LANES_1>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 2
        case 2: sr_bin_rows<SR_LANES_2>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 3
        case 3: sr_bin_rows<SR_LANES_3>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 4
        case 4: sr_bin_rows<SR_LANES_4>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 5
        case 5: sr_bin_rows<SR_LANES_5>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 6
        case 6: sr_bin_rows<SR_LANES_6>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 7
        case 7: sr_bin_rows<SR_LANES_7>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
#if SR_NBINS > 8
        case 8: sr_bin_rows<SR_LANES_8>(rowptr, col, val, x, y, perm, lo, hi, local); break;
#endif
        default: break;
        }
    }
}
