// ---- sparserl prelude (inlined by torch_sparserl/specialize/families.py; needs SR_DTYPE) ----
// Value type T by dtype, fp32 accumulation, scalar/vector load, store and atomic helpers.
// SR_DTYPE: 0 = f32, 1 = f16, 2 = bf16.
#if SR_DTYPE == 1
#include <cuda_fp16.h>
typedef __half T;
typedef __half2 T2;
#elif SR_DTYPE == 2
#include <cuda_bf16.h>
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#else
typedef float T;
#endif

#define SR_FULL 0xffffffffu

__device__ __forceinline__ float sr_to_f(T v) {
#if SR_DTYPE == 1
    return __half2float(v);
#elif SR_DTYPE == 2
    return __bfloat162float(v);
#else
    return v;
#endif
}

__device__ __forceinline__ T sr_from_f(float v) {
#if SR_DTYPE == 1
    return __float2half_rn(v);
#elif SR_DTYPE == 2
    return __float2bfloat16_rn(v);
#else
    return v;
#endif
}

#if SR_DTYPE != 0
// Two packed 16-bit values (low half = lower address) to floats.
__device__ __forceinline__ float2 sr_unpack2(unsigned int u) {
#if SR_DTYPE == 1
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
#else
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
#endif
}
__device__ __forceinline__ unsigned int sr_pack2(float a, float b) {
#if SR_DTYPE == 1
    __half2 h = __floats2half2_rn(a, b);
#else
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
#endif
    return *reinterpret_cast<unsigned int*>(&h);
}
#endif

// Read-only scalar load through the non-coherent cache, converted to float.
__device__ __forceinline__ float sr_ld(const T* __restrict__ p) {
#if SR_DTYPE == 0
    return __ldg(p);
#else
    unsigned short u = __ldg(reinterpret_cast<const unsigned short*>(p));
#if SR_DTYPE == 1
    return __half2float(__ushort_as_half(u));
#else
    return __bfloat162float(__ushort_as_bfloat16(u));
#endif
#endif
}

__device__ __forceinline__ void sr_st(T* p, float v) { *p = sr_from_f(v); }

// Atomic accumulation into y (only with init=zero plans: float32 ones, since a half-precision y
// would round every partial sum; half plans sum pieces in a float32 workspace, sr_hub_last).
__device__ __forceinline__ void sr_atomic(T* p, float v) {
#if SR_DTYPE == 0
    atomicAdd(p, v);
#else
    atomicAdd(p, sr_from_f(v));
#endif
}

// VEC consecutive elements of X (p aligned to VEC elements): one 4/8/16-byte load where possible.
template <int VEC>
__device__ __forceinline__ void sr_ldv(const T* __restrict__ p, float (&o)[VEC]) {
#if SR_DTYPE == 0
    if constexpr (VEC == 4) {
        float4 v = __ldg(reinterpret_cast<const float4*>(p));
        o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
    } else if constexpr (VEC == 2) {
        float2 v = __ldg(reinterpret_cast<const float2*>(p));
        o[0] = v.x; o[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = __ldg(p + i);
    }
#else
    if constexpr (VEC == 8) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        float2 a = sr_unpack2(v.x), b = sr_unpack2(v.y), c = sr_unpack2(v.z), d = sr_unpack2(v.w);
        o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y; o[4] = c.x; o[5] = c.y; o[6] = d.x; o[7] = d.y;
    } else if constexpr (VEC == 4) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        float2 a = sr_unpack2(v.x), b = sr_unpack2(v.y);
        o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
    } else if constexpr (VEC == 2) {
        float2 a = sr_unpack2(__ldg(reinterpret_cast<const unsigned int*>(p)));
        o[0] = a.x; o[1] = a.y;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = sr_ld(p + i);
    }
#endif
}

// Store VEC consecutive results (p aligned to VEC elements).
template <int VEC>
__device__ __forceinline__ void sr_stv(T* p, const float (&a)[VEC]) {
#if SR_DTYPE == 0
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(a[0], a[1], a[2], a[3]);
    } else if constexpr (VEC == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(a[0], a[1]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p[i] = a[i];
    }
#else
    if constexpr (VEC == 8) {
        *reinterpret_cast<uint4*>(p) = make_uint4(sr_pack2(a[0], a[1]), sr_pack2(a[2], a[3]),
                                                  sr_pack2(a[4], a[5]), sr_pack2(a[6], a[7]));
    } else if constexpr (VEC == 4) {
        *reinterpret_cast<uint2*>(p) = make_uint2(sr_pack2(a[0], a[1]), sr_pack2(a[2], a[3]));
    } else if constexpr (VEC == 2) {
        *reinterpret_cast<unsigned int*>(p) = sr_pack2(a[0], a[1]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p[i] = sr_from_f(a[i]);
    }
#endif
}

// VEC consecutive float32 atomic adds (p aligned to VEC floats): float2/float4 vector atomics on
// sm_90. Used for f32 outputs and for the float32 workspace of half-precision hub rows.
template <int VEC>
__device__ __forceinline__ void sr_atomicv_f32(float* p, const float (&a)[VEC]) {
#if __CUDA_ARCH__ >= 900
    if constexpr (VEC % 4 == 0) {
#pragma unroll
        for (int i = 0; i < VEC; i += 4)
            atomicAdd(reinterpret_cast<float4*>(p + i), make_float4(a[i], a[i + 1], a[i + 2], a[i + 3]));
        return;
    } else if constexpr (VEC == 2) {
        atomicAdd(reinterpret_cast<float2*>(p), make_float2(a[0], a[1]));
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < VEC; ++i) atomicAdd(p + i, a[i]);
}

// Atomic accumulation of VEC consecutive results into y: f32 only. The half types' pieces of a
// row meet in a float32 workspace instead (sr_hub_last); their paired 16-bit atomics compile (a
// kernel of a family that can store a row in pieces instantiates them) but no half plan that
// would need them parses.
template <int VEC>
__device__ __forceinline__ void sr_atomicv(T* p, const float (&a)[VEC]) {
#if SR_DTYPE == 0
    sr_atomicv_f32<VEC>(p, a);
#else
    if constexpr (VEC % 2 == 0) {
#pragma unroll
        for (int i = 0; i < VEC; i += 2) {
            unsigned int u = sr_pack2(a[i], a[i + 1]);
            atomicAdd(reinterpret_cast<T2*>(p + i), *reinterpret_cast<T2*>(&u));
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) atomicAdd(p + i, sr_from_f(a[i]));
    }
#endif
}

// Hub rows (split=rowchunks, nnz): each group of W lanes (an aligned power of two <= 32) has
// added its piece of the row to the row's float32 workspace slot; `count` is the slot's counter
// (zero before the launch). Returns, to every lane of the group, whether this group added the
// row's last piece of `pieces`: it then reads the finished sums (__ldcg: from L2, where the
// atomics landed), stores the row once (rounded once) and zeroes the sums (the caller does
// both). The counter is zero again on return, so the workspace is left as it was found
// (work_init=once). The group must be converged.
template <int W>
__device__ __forceinline__ bool sr_hub_last(int* count, int pieces) {
    const int lane = threadIdx.x & 31;
    const int leader = lane & ~(W - 1);
    const unsigned mask = W == 32 ? SR_FULL : (((1u << W) - 1u) << leader);
    __threadfence();  // this lane's adds are visible device-wide before the count moves
    __syncwarp(mask);
    int last = 0;
    if (lane == leader) {
        last = atomicAdd(count, 1) == pieces - 1;
        if (last) atomicExch(count, 0);  // every piece has counted: no other group touches it now
    }
    last = __shfl_sync(mask, last, leader);
    if (last) __threadfence();  // the other groups' adds, counted before ours, are read after it
    return last != 0;
}

// Sum over aligned groups of W lanes (W a power of two ≤ 32). Every lane of the warp must call it.
template <int W>
__device__ __forceinline__ float sr_group_sum(float v) {
#pragma unroll
    for (int off = W / 2; off > 0; off >>= 1) v += __shfl_xor_sync(SR_FULL, v, off);
    return v;
}
// ---- end of prelude ----
