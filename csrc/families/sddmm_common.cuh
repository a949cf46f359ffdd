// ---- sparserl SDDMM helpers (inlined after the SpMM helpers for op=sddmm) ----
// op=sddmm: `val` holds the left dense operand D (rows x SR_N), `x` the right one X
// (cols x SR_N), `y` one value per nonzero: y[k] = dot(D[row(k)], X[col(k)]).
// A group of SR_LANES lanes keeps its row of D in registers (the column tiles of
// spmm_common.cuh, in one pass: the renderer refuses SR_PASSES > 1) and computes one dot
// product per nonzero, summed across the group by shuffles that name only the group's lanes,
// so groups of one warp may walk rows of different lengths.
#if SR_PASSES != 1
#error "op=sddmm keeps a whole row of D in registers: SR_PASSES must be 1"
#endif

// This lane's columns of D[row] (zero past SR_N, so ragged tiles add nothing).
__device__ __forceinline__ void sr_load_row(float (&d)[SR_TB][SR_VEC], const T* __restrict__ drow, int col0) {
#pragma unroll
    for (int t = 0; t < SR_TB; ++t) {
        const int cc = col0 + t * SR_W;
        if (SR_EXACT || cc < SR_N) {
            sr_ldv<SR_VEC>(drow + cc, d[t]);
        } else {
#pragma unroll
            for (int i = 0; i < SR_VEC; ++i) d[t][i] = 0.f;
        }
    }
}

// This lane's share of dot(D[row], X[c]) (xrow = x + c*SR_N).
__device__ __forceinline__ float sr_dot_part(const float (&d)[SR_TB][SR_VEC], const T* __restrict__ xrow, int col0) {
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < SR_TB; ++t) {
        const int cc = col0 + t * SR_W;
        if (SR_EXACT || cc < SR_N) {
            float xv[SR_VEC];
            sr_ldv<SR_VEC>(xrow + cc, xv);
#pragma unroll
            for (int i = 0; i < SR_VEC; ++i) s = fmaf(d[t][i], xv[i], s);
        }
    }
    return s;
}

// The lanes of this thread's group (SR_LANES aligned lanes of its warp).
__device__ __forceinline__ unsigned sr_group_mask() {
#if SR_LANES == 32
    return SR_FULL;
#else
    return ((1u << SR_LANES) - 1u) << ((threadIdx.x % 32) & ~(SR_LANES - 1));
#endif
}

// Sum over the group; every lane of the group gets the total.
__device__ __forceinline__ float sr_group_total(float v, unsigned mask) {
#pragma unroll
    for (int off = SR_LANES / 2; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off);
    return v;
}

// y[j] = dot(D[row], X[col[j]]) for the nonzeros [j, end) of one row, whose D tile is `d`;
// SR_UNROLL gathers of X in flight, and the SR_UNROLL results stored by different lanes.
__device__ __forceinline__ void sr_row_sample(const float (&d)[SR_TB][SR_VEC], const int* __restrict__ col,
                                              const T* __restrict__ x, T* __restrict__ y, int j, int end,
                                              int col0, int gl, unsigned mask) {
    for (; j + SR_UNROLL <= end; j += SR_UNROLL) {
        int c[SR_UNROLL];
        float s[SR_UNROLL];
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) c[u] = __ldg(col + j + u);
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) s[u] = sr_dot_part(d, x + (size_t)c[u] * SR_N, col0);
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) {
            s[u] = sr_group_total(s[u], mask);
            if (gl == u % SR_LANES) sr_st(y + j + u, s[u]);
        }
    }
#if SR_UNROLL > 1
    for (; j < end; ++j) {
        const float s = sr_group_total(sr_dot_part(d, x + (size_t)__ldg(col + j) * SR_N, col0), mask);
        if (gl == 0) sr_st(y + j, s);
    }
#endif
}
// ---- end of SDDMM helpers ----
