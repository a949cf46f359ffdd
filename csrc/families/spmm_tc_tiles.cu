// Family tc_tiles (SpMM): tensor cores (nvcuda::wmma) over condensed tiles (plan split=tiles(W)).
// One warp owns a window of SR_WIN rows and a slice of SR_S = 16*SR_J columns of Y. Each step
// takes the window's next SR_KK distinct columns (four blocks of 8): it builds the dense
// SR_WIN x SR_KK tile of A from their nonzeros, stages those SR_KK rows of X, and multiplies on
// the tensor cores. A step's sum is added to float32 registers (the tensor cores' own
// accumulation over a long row would round more than float32's).
// Why fast: a row of X is gathered once per window, not once per nonzero, so patterns whose
// rows share columns (meshes, banded and block patterns: several nonzeros per distinct column
// in a window) read X that many times less; one step pays its chain of dependent loads (the
// nonzeros' slots, their values, the columns' rows of X) for 32 columns at once.
// float32 (SR_MATH 3) splits each operand into a high and a low TF32 part and adds three products
// (the low x low term is below float32's rounding); SR_MATH 1 (plan math=tf32) keeps one.
// Duplicate nonzeros add up in the tile (shared-memory atomics). Each row of Y is stored once.
// SR_KSPLIT warps share a window and slice, each taking every SR_KSPLIT-th step: more warps in
// flight to hide that chain, and a hub row's window no longer one warp's tail. They add their
// partial tiles atomically into zero-filled Y (plan init=zero; float32 only). With SR_KSPLIT 1 a
// warp runs all of its window's steps and stores each row of Y once.
// Needs: SR_BLOCK, SR_N, SR_WIN (16 or 32), SR_J, SR_SLICES (SR_N / (16*SR_J)), SR_KSPLIT,
//        SR_MATH (0 half).
#include <mma.h>

#define SR_MT (SR_WIN / 16)
#define SR_WARPS (SR_BLOCK / 32)
#define SR_S (16 * SR_J)
#define SR_KK 32  // columns per step: four blocks of 8
#if SR_DTYPE == 0
#define SR_KF 8   // columns per tensor-core product (TF32: m16n16k8)
#define SR_V 4
typedef float4 SrVec;
typedef float SrTile;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 8, nvcuda::wmma::precision::tf32,
                               nvcuda::wmma::row_major> SrFragA;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 8, nvcuda::wmma::precision::tf32,
                               nvcuda::wmma::row_major> SrFragB;
#else
#define SR_KF 16  // (half types: m16n16k16)
#define SR_V 8
typedef uint4 SrVec;
typedef T SrTile;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, T, nvcuda::wmma::row_major> SrFragA;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, T, nvcuda::wmma::row_major> SrFragB;
#endif
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, SR_KF, float> SrFragC;

// Per warp, in floats (each part a multiple of 32 bytes, the alignment wmma loads need):
// the float32 A tile, the staged X rows, one 16x16 output tile, and (half types) A as T.
#define SR_A_FLOATS (SR_WIN * SR_KK)
#define SR_B_FLOATS (SR_KK * SR_S * (int)sizeof(SrTile) / 4)
#define SR_AH_FLOATS (SR_DTYPE == 0 ? 0 : SR_WIN * SR_KK / 2)
#define SR_PER_WARP (SR_A_FLOATS + SR_B_FLOATS + 256 + SR_AH_FLOATS)

#if SR_DTYPE == 0
// v = hi + lo in TF32 (lo dropped with SR_MATH 1)
template <typename Frag>
__device__ __forceinline__ void sr_tf32_split(Frag& hi, Frag& lo) {
#pragma unroll
    for (int t = 0; t < hi.num_elements; ++t) {
        const float v = hi.x[t];
        hi.x[t] = nvcuda::wmma::__float_to_tf32(v);
#if SR_MATH == 3
        lo.x[t] = nvcuda::wmma::__float_to_tf32(v - hi.x[t]);
#endif
    }
}
#endif

extern "C" __global__ void __launch_bounds__(SR_BLOCK, SR_MINB) sparserl_kernel(
    const int* __restrict__ rowptr, const int* __restrict__ col, const T* __restrict__ val,
    const T* __restrict__ x, T* __restrict__ y, const int* __restrict__ aux,
    float* __restrict__ work, int rows, int cols, int n, int nnz, int parts)
{
    __shared__ __align__(128) float sr_smem[SR_WARPS * SR_PER_WARP];
    const int lane = threadIdx.x & 31;
    const int warp = (int)((blockIdx.x * (unsigned)SR_BLOCK + threadIdx.x) >> 5);
    const int win = warp / (SR_SLICES * SR_KSPLIT);
    if (win >= parts) return;  // a whole warp: no wmma call is left half-joined
    const int n0 = (warp / SR_KSPLIT % SR_SLICES) * SR_S, ks = warp % SR_KSPLIT;
    float* at = sr_smem + (threadIdx.x >> 5) * SR_PER_WARP;
    SrTile* bt = reinterpret_cast<SrTile*>(at + SR_A_FLOATS);
    float* ct = at + SR_A_FLOATS + SR_B_FLOATS;
    const int blocks = __ldg(aux + parts);
    const int* blk_col = aux + parts + 1;
    const int* blk_nz = blk_col + 8 * blocks;
    const int* nz_idx = blk_nz + blocks + 1;
    const int* nz_slot = nz_idx + nnz;
    const int first = __ldg(aux + win), last = __ldg(aux + win + 1);
    if (SR_KSPLIT > 1 && first + ks * (SR_KK / 8) >= last) return;  // no step for this warp: Y is zero-filled

    SrFragC acc[SR_MT][SR_J];
#pragma unroll
    for (int m = 0; m < SR_MT; ++m)
#pragma unroll
        for (int j = 0; j < SR_J; ++j) nvcuda::wmma::fill_fragment(acc[m][j], 0.f);

#pragma unroll 1
    for (int b = first + ks * (SR_KK / 8); b < last; b += SR_KSPLIT * (SR_KK / 8)) {
        const int blocks_here = min(SR_KK / 8, last - b), width = blocks_here * 8;
        const int base = (b - first) * 8;  // the window rank of the step's first column
        // A: zero, then add the step's nonzeros at (row, rank - base); their slots are rank*32 + row
#pragma unroll
        for (int i = lane * 4; i < SR_A_FLOATS; i += 128)
            *reinterpret_cast<float4*>(at + i) = make_float4(0.f, 0.f, 0.f, 0.f);
        __syncwarp();
        const int e = __ldg(blk_nz + b + blocks_here);
        for (int i = __ldg(blk_nz + b) + lane; i < e; i += 32) {
            const int slot = __ldg(nz_slot + i);
            atomicAdd(at + (slot & 31) * SR_KK + (slot >> 5) - base, sr_ld(val + __ldg(nz_idx + i)));
        }
        // B: row k of the tile is X's row of the step's k-th column (zeros past the window's last)
#pragma unroll
        for (int i = lane; i < SR_KK * SR_S / SR_V; i += 32) {
            const int k = i / (SR_S / SR_V), q = (i % (SR_S / SR_V)) * SR_V;
            const int c = k < width ? __ldg(blk_col + b * 8 + k) : -1;
            SrVec v;
#if SR_DTYPE == 0
            v = make_float4(0.f, 0.f, 0.f, 0.f);
#else
            v = make_uint4(0u, 0u, 0u, 0u);
#endif
            if (c >= 0) v = __ldg(reinterpret_cast<const SrVec*>(x + (size_t)c * SR_N + n0 + q));
            *reinterpret_cast<SrVec*>(bt + k * SR_S + q) = v;
        }
        __syncwarp();
        SrFragC part[SR_MT][SR_J];
#pragma unroll
        for (int m = 0; m < SR_MT; ++m)
#pragma unroll
            for (int j = 0; j < SR_J; ++j) nvcuda::wmma::fill_fragment(part[m][j], 0.f);
#if SR_DTYPE != 0
        T* ah = reinterpret_cast<T*>(ct + 256);
#pragma unroll
        for (int i = lane; i < SR_A_FLOATS; i += 32) ah[i] = sr_from_f(at[i]);
        __syncwarp();
#endif
#pragma unroll
        for (int kf = 0; kf < SR_KK; kf += SR_KF) {
            if (kf >= width) break;  // warp-uniform: the rest of the tile is padding
#if SR_DTYPE == 0
            SrFragA a_hi[SR_MT], a_lo[SR_MT];
#pragma unroll
            for (int m = 0; m < SR_MT; ++m) {
                nvcuda::wmma::load_matrix_sync(a_hi[m], at + m * 16 * SR_KK + kf, SR_KK);
                sr_tf32_split(a_hi[m], a_lo[m]);
            }
#pragma unroll
            for (int j = 0; j < SR_J; ++j) {
                SrFragB b_hi, b_lo;
                nvcuda::wmma::load_matrix_sync(b_hi, bt + kf * SR_S + j * 16, SR_S);
                sr_tf32_split(b_hi, b_lo);
#pragma unroll
                for (int m = 0; m < SR_MT; ++m) {
#if SR_MATH == 3
                    nvcuda::wmma::mma_sync(part[m][j], a_lo[m], b_hi, part[m][j]);
                    nvcuda::wmma::mma_sync(part[m][j], a_hi[m], b_lo, part[m][j]);
#endif
                    nvcuda::wmma::mma_sync(part[m][j], a_hi[m], b_hi, part[m][j]);
                }
            }
#else
            SrFragA a[SR_MT];
#pragma unroll
            for (int m = 0; m < SR_MT; ++m) nvcuda::wmma::load_matrix_sync(a[m], ah + m * 16 * SR_KK + kf, SR_KK);
#pragma unroll
            for (int j = 0; j < SR_J; ++j) {
                SrFragB bf;
                nvcuda::wmma::load_matrix_sync(bf, bt + kf * SR_S + j * 16, SR_S);
#pragma unroll
                for (int m = 0; m < SR_MT; ++m) nvcuda::wmma::mma_sync(part[m][j], a[m], bf, part[m][j]);
            }
#endif
        }
#pragma unroll
        for (int m = 0; m < SR_MT; ++m)
#pragma unroll
            for (int j = 0; j < SR_J; ++j)
#pragma unroll
                for (int t = 0; t < acc[m][j].num_elements; ++t) acc[m][j].x[t] += part[m][j].x[t];
        __syncwarp();  // the tiles are rewritten by the next step
    }

    // Y: each 16x16 accumulator tile through shared memory, 8 consecutive columns per lane
    const int r = lane >> 1, c8 = (lane & 1) * 8;
#pragma unroll
    for (int m = 0; m < SR_MT; ++m) {
        const int row = win * SR_WIN + m * 16 + r;
#pragma unroll
        for (int j = 0; j < SR_J; ++j) {
            nvcuda::wmma::store_matrix_sync(ct, acc[m][j], 16, nvcuda::wmma::mem_row_major);
            __syncwarp();
            if (row < rows) {
                float o[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] = ct[r * 16 + c8 + i];
                T* yp = y + (size_t)row * SR_N + n0 + j * 16 + c8;
#if SR_KSPLIT > 1
                sr_atomicv_f32<8>(reinterpret_cast<float*>(yp), o);
#elif SR_DTYPE == 0
                sr_stv<4>(yp, *reinterpret_cast<const float(*)[4]>(o));
                sr_stv<4>(yp + 4, *reinterpret_cast<const float(*)[4]>(o + 4));
#else
                sr_stv<8>(yp, o);
#endif
            }
            __syncwarp();
        }
    }
}
