// ---- sparserl SpMM helpers (inlined after the prelude for op=spmm) ----
// A lane owns SR_VEC consecutive columns of every column tile of width SR_W = SR_LANES*SR_VEC;
// SR_TB tiles are held in registers per pass, SR_PASSES passes cover SR_N columns.
// Needs: SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES (renderer checks SR_N % SR_VEC == 0).
#define SR_W (SR_LANES * SR_VEC)
// true when every tile column of every pass is inside [0, SR_N): no bounds checks needed
#define SR_EXACT (SR_N % (SR_W * SR_TB) == 0)

__device__ __forceinline__ void sr_acc_zero(float (&acc)[SR_TB][SR_VEC]) {
#pragma unroll
    for (int t = 0; t < SR_TB; ++t)
#pragma unroll
        for (int i = 0; i < SR_VEC; ++i) acc[t][i] = 0.f;
}

// acc += v * X[c, col0 + t*SR_W .. +SR_VEC) for the tiles of this pass (xrow = x + c*SR_N).
__device__ __forceinline__ void sr_axpy(float (&acc)[SR_TB][SR_VEC], float v, const T* __restrict__ xrow, int col0) {
#pragma unroll
    for (int t = 0; t < SR_TB; ++t) {
        const int cc = col0 + t * SR_W;
        if (SR_EXACT || cc < SR_N) {
            float xv[SR_VEC];
            sr_ldv<SR_VEC>(xrow + cc, xv);
#pragma unroll
            for (int i = 0; i < SR_VEC; ++i) acc[t][i] = fmaf(v, xv[i], acc[t][i]);
        }
    }
}

// Write (atomic == false) or atomically add the accumulators to y[row, ...].
__device__ __forceinline__ void sr_flush(T* __restrict__ y, int row, int col0, float (&acc)[SR_TB][SR_VEC], bool atomic) {
    T* yrow = y + (size_t)row * SR_N;
#pragma unroll
    for (int t = 0; t < SR_TB; ++t) {
        const int cc = col0 + t * SR_W;
        if (SR_EXACT || cc < SR_N) {
            if (atomic) sr_atomicv<SR_VEC>(yrow + cc, acc[t]);
            else sr_stv<SR_VEC>(yrow + cc, acc[t]);
        }
    }
}

#ifdef SR_UNROLL
// Sequential pass over nonzeros [j, end) of one row, SR_UNROLL independent rows of X in flight.
__device__ __forceinline__ void sr_row_accumulate(float (&acc)[SR_TB][SR_VEC], const int* __restrict__ col,
                                                  const T* __restrict__ val, const T* __restrict__ x,
                                                  int j, int end, int col0) {
    for (; j + SR_UNROLL <= end; j += SR_UNROLL) {
        int c[SR_UNROLL];
        float v[SR_UNROLL];
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) {
            c[u] = __ldg(col + j + u);
            v[u] = sr_ld(val + j + u);
        }
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) sr_axpy(acc, v[u], x + (size_t)c[u] * SR_N, col0);
    }
#if SR_UNROLL > 1
    for (; j < end; ++j) sr_axpy(acc, sr_ld(val + j), x + (size_t)__ldg(col + j) * SR_N, col0);
#endif
}
#endif
// ---- end of SpMM helpers ----
