// ---- sparserl SpMM helpers (inlined after the prelude for op=spmm) ----
// A lane owns SR_VEC consecutive columns of every column tile of width SR_W = SR_LANES*SR_VEC;
// SR_TB tiles are held in registers per pass, SR_PASSES passes cover SR_N columns.
// Needs: SR_N, SR_LANES, SR_VEC, SR_TB, SR_PASSES (renderer checks SR_N % SR_VEC == 0).
#define SR_W (SR_LANES * SR_VEC)
// true when every tile column of every pass is inside [0, SR_N): no bounds checks needed
#define SR_EXACT (SR_N % (SR_W * SR_TB) == 0)

// Epilogue (plan key epilogue=; SR_EPILOGUE bits 1 scale, 2 bias, 4 relu). A kernel whose plan
// has one takes two more parameters after `parts`, SR_EPILOGUE_PARAMS: bias (SR_N values,
// 16-byte aligned) and scale (one per row), either null when its step is absent; it applies
// y = relu(scale[row] * acc + bias) to each finished tile before the store (sr_epilogue).
#ifndef SR_EPILOGUE
#define SR_EPILOGUE 0
#endif
#if SR_EPILOGUE
#define SR_EPILOGUE_PARAMS , const T* __restrict__ sr_bias, const T* __restrict__ sr_scale
#else
#define SR_EPILOGUE_PARAMS
#endif

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

#if SR_EPILOGUE
__device__ __forceinline__ void sr_epilogue(float (&acc)[SR_TB][SR_VEC], int row, int col0,
                                            const T* __restrict__ bias, const T* __restrict__ scale) {
#if SR_EPILOGUE & 1
    const float s = sr_ld(scale + row);
#endif
#pragma unroll
    for (int t = 0; t < SR_TB; ++t) {
        const int cc = col0 + t * SR_W;
        float b[SR_VEC];
#pragma unroll
        for (int i = 0; i < SR_VEC; ++i) b[i] = 0.f;
#if SR_EPILOGUE & 2
        if (SR_EXACT || cc < SR_N) sr_ldv<SR_VEC>(bias + cc, b);
#endif
#pragma unroll
        for (int i = 0; i < SR_VEC; ++i) {
            float v = acc[t][i];
#if SR_EPILOGUE & 1
            v *= s;
#endif
            v += b[i];
#if SR_EPILOGUE & 4
            v = v < 0.f ? 0.f : v;  // NaN stays NaN, as torch.relu keeps it
#endif
            acc[t][i] = v;
        }
    }
}
#endif

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

// Rows stored in pieces (split=rowchunks, split=nnz) meet in a float32 workspace slot per hub
// row (plan work=hubs*SR_HUB): SR_N sums, padded to 16 bytes, then the slot's counter
// (sr_hub_last). The group that added a row's last piece stores the row from its slot (read from
// L2, __ldcg, where the atomics landed; a half-precision row rounded once) and zeroes the slot
// again, so the workspace is zero after every launch (work_init=once).
#define SR_HUB (((SR_N + 3) / 4) * 4 + 4)
__device__ __forceinline__ void sr_hub_add(float* hub, int col0, const float (&acc)[SR_TB][SR_VEC]) {
#pragma unroll
    for (int t = 0; t < SR_TB; ++t) {
        const int cc = col0 + t * SR_W;
        if (SR_EXACT || cc < SR_N) sr_atomicv_f32<SR_VEC>(hub + cc, acc[t]);
    }
}
__device__ __forceinline__ void sr_store_hub(T* __restrict__ y, int row, int gl, float* hub) {
#pragma unroll 1
    for (int pass = 0; pass < SR_PASSES; ++pass) {
        const int col0 = pass * SR_TB * SR_W + gl * SR_VEC;
        float acc[SR_TB][SR_VEC];
#pragma unroll
        for (int t = 0; t < SR_TB; ++t) {
            const int cc = col0 + t * SR_W;
#pragma unroll
            for (int i = 0; i < SR_VEC; ++i) {
                const bool mine = SR_EXACT || cc < SR_N;
                acc[t][i] = mine ? __ldcg(hub + cc + i) : 0.f;
                if (mine) __stcg(hub + cc + i, 0.f);  // what sr_hub_add added: zero for the next launch
            }
        }
        sr_flush(y, row, col0, acc, false);
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
