"""The nnz_split SpMV kernel outside the kernel ABI that the x-gather probes vary
(``probes/probe_hot_x.py``, ``probes/probe_cluster_x.py``), and the operands they time it on.

The kernels are compiled and launched through the project's NVRTC and driver wrappers and
timed against ``torch.addmv`` (cuSPARSE) on the same operands.
"""

from __future__ import annotations

# The nnz_split SpMV loop over a persistent grid's warps (chunks of CHUNK nonzeros, a segmented
# warp scan, atomics at chunk edges); LOAD_X(c) is x's value for the column entry c.
NNZ_SPLIT_LOOP = r'''
  const int lane = threadIdx.x & 31;
  const int wpb = BLOCK / 32;
  for (int warp = blockIdx.x * wpb + (threadIdx.x >> 5); warp < parts; warp += gridDim.x * wpb) {
    const int cstart = warp * CHUNK;
    const int cend = min(cstart + CHUNK, nnz);
    const int rlast = min(__ldg(part_row + warp + 1), rows - 1);
    int lo = __ldg(part_row + warp);
    float carry = 0.f; int carry_row = -1;
    for (int base = cstart; base < cend; base += 32) {
      const int k = base + lane;
      const bool valid = k < cend;
      int row = 0x7fffffff; float prod = 0.f;
      if (valid) {
        int a = lo, b = rlast;
        while (a < b) { const int m = (a + b + 1) >> 1; if (__ldg(rowptr + m) <= k) a = m; else b = m - 1; }
        row = a;
        const int c = LDI(colx + k);
        prod = LDF(val + k) * LOAD_X(c);
      }
      const int row0 = __shfl_sync(FULL, row, 0);
      if (carry_row >= 0) {
        if (row0 == carry_row) { if (lane == 0) prod += carry; }
        else if (lane == 0) {
          const bool owned = __ldg(rowptr + carry_row) >= cstart && __ldg(rowptr + carry_row + 1) <= cend;
          if (owned) y[carry_row] = carry; else atomicAdd(y + carry_row, carry);
        }
        carry_row = -1;
      }
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float up = __shfl_up_sync(FULL, prod, off);
        const int rup = __shfl_up_sync(FULL, row, off);
        if (lane >= off && rup == row) prod += up;
      }
      const int next_row = __shfl_down_sync(FULL, row, 1);
      const float last = __shfl_sync(FULL, prod, 31);
      const int last_row = __shfl_sync(FULL, row, 31);
      if (valid && lane < 31 && next_row != row) {
        const bool owned = __ldg(rowptr + row) >= cstart && __ldg(rowptr + row + 1) <= cend;
        if (owned) y[row] = prod; else atomicAdd(y + row, prod);
      }
      if (last_row != 0x7fffffff) { carry = last; carry_row = last_row; lo = last_row; }
    }
    if (carry_row >= 0 && lane == 0) {
      const bool owned = __ldg(rowptr + carry_row) >= cstart && __ldg(rowptr + carry_row + 1) <= cend;
      if (owned) y[carry_row] = carry; else atomicAdd(y + carry_row, carry);
    }
  }
'''

# spmv_hot: the H most-gathered entries of x (``hot``) in shared memory, the column array remapped
# to ``~slot`` for them; H = 0 is the plain nnz_split kernel (the cluster probe's control)
HOT_X_SOURCE = r'''
#define FULL 0xffffffffu
#if STREAM
#define LDI(p) __ldcs(p)
#define LDF(p) __ldcs(p)
#else
#define LDI(p) __ldg(p)
#define LDF(p) __ldg(p)
#endif
extern "C" __global__ void __launch_bounds__(BLOCK) spmv_hot(
  const int* __restrict__ rowptr, const int* __restrict__ colx, const float* __restrict__ val,
  const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ part_row,
  const int* __restrict__ hot, int H, int rows, int nnz, int parts)
{
  extern __shared__ float xs[];
  for (int i = threadIdx.x; i < H; i += BLOCK) xs[i] = __ldg(x + __ldg(hot + i));
  __syncthreads();
#define LOAD_X(c) ((c) < 0 ? xs[~(c)] : __ldg(x + (c)))
''' + NNZ_SPLIT_LOOP + '}\n'


def nnz_split_parts(rowptr, col, shape, chunk: int):
    """(part_row[parts + 1], parts): the split=nnz(chunk) partition as the runtime prepares it."""
    from torch_sparserl.abi.prepare import prepare
    from torch_sparserl.specialize.families import render

    plan = render("nnz_split", {"chunk": chunk}, op="spmv", dtype="f32", n=1).plan
    prepared = prepare(plan, rowptr, col, shape, 1)
    return prepared.aux, prepared.parts


def spmv_operands(A, median_us):
    """A's pattern and random operands on the GPU, the float64 product, the scale errors are
    relative to, and cuSPARSE's median µs (``torch.addmv``) on them."""
    import numpy as np
    import torch

    rowptr = torch.from_numpy(A.indptr.astype(np.int32)).cuda()
    col = torch.from_numpy(A.indices.astype(np.int32)).cuda()
    val, x = torch.randn(col.numel(), device="cuda"), torch.randn(A.shape[1], device="cuda")
    ref = torch.sparse_csr_tensor(rowptr.long(), col.long(), val.double(), A.shape) @ x.double()
    csr = torch.sparse_csr_tensor(rowptr, col, val, A.shape)
    out = torch.empty(A.shape[0], device="cuda")
    cusparse = median_us(lambda: torch.addmv(out, csr, x, beta=0, alpha=1, out=out))
    return rowptr, col, val, x, ref, max(1.0, float(ref.abs().max())), cusparse
