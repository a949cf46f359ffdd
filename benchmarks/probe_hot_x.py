"""Probe (tried, not adopted): SpMV with the most-gathered entries of x held in shared memory.

Issue 37's ncu profiles put large SpMV on L2 throughput, spent on gathering x. This probe asks
whether keeping the H most-gathered entries of x in shared memory removes enough of those
gathers to pay for loading them into every block. Per pattern it ranks columns by degree,
keeps the top H (ascending), and writes a remapped column array: ``~slot`` for a kept column,
the column itself otherwise. The kernel is the nnz_split SpMV (fixed nonzero chunks, a
segmented warp scan, atomics at chunk edges) run by persistent blocks that first load their
H entries; ``stream`` loads the column and value streams with ``__ldcs`` (evict first) so
they leave L1 to x. H = 0 is the plain kernel, the control. Outside the kernel ABI (two extra
arguments), so it is compiled and launched here through the project's NVRTC and driver
wrappers, and timed as the evaluation harness times kernels (L2 flushed before each run),
against ``torch.addmv`` (cuSPARSE) on the same operands::

    python benchmarks/probe_hot_x.py rmat-s20-ef16,uk-2007-05_100000,fb100_Cornell5 --out results.json

Needs a CUDA GPU; the matrices are named as ``bench_kernels.py`` names them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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

SOURCE = r'''
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

# (H, block, blocks per SM, stream); blocks per SM 0: one block per chunk group, not persistent
VARIANTS = [(0, 256, 0, 0), (0, 256, 0, 1), (0, 512, 4, 0), (6144, 512, 4, 0), (12288, 512, 4, 0),
            (12288, 512, 4, 1), (12288, 1024, 2, 0), (24576, 1024, 2, 0), (24576, 512, 2, 0),
            (49152, 1024, 1, 0), (49152, 1024, 1, 1)]


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("matrices", help="comma-separated names known to bench_kernels.py")
    parser.add_argument("--chunks", default="128,256", help="nonzeros per warp chunk, comma-separated")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write the timings as JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        parser.error("probe_hot_x launches GPU kernels: no CUDA device here")
    from bench_kernels import known_matrices
    from torch_sparserl.evaluate.config import DEFAULT_FLUSH_BYTES
    from torch_sparserl.evaluate.harness import _flush_buffer, _time
    from torch_sparserl.toolchain import driver
    from torch_sparserl.toolchain.nvrtc import device_arch

    entries = known_matrices()
    unknown = [m for m in args.matrices.split(",") if m not in entries]
    if unknown:
        parser.error(f"unknown matrices: {', '.join(unknown)}")
    modules = {}

    def module(block, chunk, stream):
        if (block, chunk, stream) not in modules:
            head = f"#define BLOCK {block}\n#define CHUNK {chunk}\n#define STREAM {stream}\n"
            image, _ = driver.nvrtc_compile(head + SOURCE, device_arch())
            modules[block, chunk, stream] = driver.Module(image, "spmv_hot")
        return modules[block, chunk, stream]

    flush = _flush_buffer(DEFAULT_FLUSH_BYTES, torch.device("cuda"))

    def median_us(fn):  # the harness's timing: L2 flushed and the GPU kept busy before each run
        return statistics.median(_time([fn], args.reps, 3, flush)[0])

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": sys.argv, "matrices": []}
    for name in args.matrices.split(","):
        A = entries[name].load().tocsr()
        rows, cols = A.shape
        rowptr, col, val, x, ref, scale, cusparse = spmv_operands(A, median_us)
        nnz = col.numel()
        order = torch.argsort(torch.bincount(col.long(), minlength=cols), descending=True)
        entry = {"matrix": name, "rows": rows, "nnz": nnz, "cusparse_us": cusparse, "variants": []}
        print(f"{name}: rows={rows} nnz={nnz} cuSPARSE {cusparse:.1f} us", flush=True)
        for chunk in map(int, args.chunks.split(",")):
            part_row, parts = nnz_split_parts(rowptr, col, A.shape, chunk)
            for hot_n, block, per_sm, stream in VARIANTS:
                hot_n = min(hot_n, cols)
                hot = torch.sort(order[:hot_n]).values.int().contiguous()
                slot = torch.full((cols,), -1, dtype=torch.int32, device="cuda")
                slot[hot.long()] = torch.arange(hot_n, dtype=torch.int32, device="cuda")
                picked = slot[col.long()]
                colx = torch.where(picked >= 0, ~picked, col).contiguous()
                y = torch.zeros(rows, device="cuda")
                groups = math.ceil(parts / (block // 32))
                grid = groups if per_sm == 0 else min(sms * per_sm, groups)
                kernel = module(block, chunk, stream)
                params = [ctypes.c_void_p(t.data_ptr()) for t in (rowptr, colx, val, x, y, part_row, hot)]
                params += [ctypes.c_int(v) for v in (hot_n, rows, nnz, parts)]
                packed = driver.pack_params(params)

                def run():
                    y.zero_()
                    kernel.launch(grid, block, 4 * hot_n, torch.cuda.current_stream().cuda_stream, packed)

                run()
                torch.cuda.synchronize()
                error = float((y.double() - ref).abs().max()) / scale
                us = median_us(run)
                entry["variants"].append({"chunk": chunk, "H": hot_n, "block": block, "blocks_per_sm": per_sm,
                                          "stream": stream, "hot_fraction": round(float((picked >= 0).float().mean()), 3),
                                          "us": us, "speedup": cusparse / us, "max_rel_error": error})
                print(f"  chunk={chunk} H={hot_n:6d} block={block} per_sm={per_sm} stream={stream} "
                      f"hot={entry['variants'][-1]['hot_fraction']:.2f} {us:8.1f} us {cusparse / us:5.2f}x "
                      f"err={error:.1e}", flush=True)
        results["matrices"].append(entry)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
