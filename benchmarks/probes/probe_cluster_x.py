"""Probe: SpMV with x spread over the shared memory of a thread-block cluster (sm_90).

The large SpMV cells are bound by L2 throughput spent gathering x: a 4-byte value costs a
32-byte sector (``results/ncu-spmv-h100-2026-11-26.md``). On sm_90 the blocks of a cluster
read each other's shared memory (distributed shared memory) word by word. Here each block of a
cluster of C loads one slice of x (``SLICE = ceil(cols / C)`` values) and every gather reads
the owner's slice through ``mapa`` and ``ld.shared::cluster``; the work is the nnz_split SpMV (chunks
of nonzeros per warp, a segmented warp scan, atomics at chunk edges) over persistent clusters.
The control is the same loop reading x from global memory (``probe_hot_x.py``'s kernel with
no cached entries). x must fit: ``cols <= C * 58 K``. Timed as the harness times kernels (L2
flushed before each run, median), against ``torch.addmv`` (cuSPARSE) on the same operands::

    python benchmarks/probes/probe_cluster_x.py uk-2007-05_100000,dblp-2010 --out cluster-x.json

Needs an sm_90 GPU; matrices are names of known matrices (``common.known_matrices``) or generator specs
(``rmat:scale=18,edge_factor=16``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the common core

from common import kernel_us, matrix_list, select_matrices  # noqa: E402
from common.spmv_probe import HOT_X_SOURCE, NNZ_SPLIT_LOOP, nnz_split_parts, spmv_operands  # noqa: E402

SOURCE_HEAD = r'''
#define FULL 0xffffffffu
// PTX for the cluster (NVRTC finds no CCCL headers for cooperative_groups here)
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ld_cluster(unsigned local_addr, unsigned rank) {  // another block's shared memory
  unsigned remote; float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK) spmv_cluster(
  const int* __restrict__ rowptr, const int* __restrict__ colx, const float* __restrict__ val,
  const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ part_row,
  int rows, int cols, int nnz, int parts)
{
  extern __shared__ float xs[];
  const int rank = (int)cluster_rank();
  const unsigned xs_addr = (unsigned)__cvta_generic_to_shared(xs);
  {
    const int first = rank * SLICE;
    const int count = max(0, min(SLICE, cols - first));
    for (int i = threadIdx.x; i < count; i += BLOCK) xs[i] = __ldg(x + first + i);
  }
  cluster_sync();
#define LDI(p) __ldg(p)
#define LDF(p) __ldg(p)
#define LOAD_X(c) ld_cluster(xs_addr + 4u * (unsigned)((c) - (c) / SLICE * SLICE), (unsigned)((c) / SLICE))
'''
SOURCE = SOURCE_HEAD + NNZ_SPLIT_LOOP + r'''
  cluster_sync();  // no block leaves while another may still read its slice
}
'''

MAX_SLICE_BYTES = 227 * 1024


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("matrices", help="comma-separated names or generator specs")
    parser.add_argument("--chunk", type=int, default=128, help="nonzeros per warp chunk")
    parser.add_argument("--clusters", default="2,4,8", help="cluster sizes to try, comma-separated")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write the timings as JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        parser.error("probe_cluster_x needs an sm_90 (or newer) CUDA device")
    from torch_sparserl.toolchain import driver
    from torch_sparserl.toolchain.nvrtc import device_arch

    entries = select_matrices(matrix_list(args.matrices))  # a usage message for unknown names
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    modules = {}

    def module(kind, **defines):
        key = (kind, tuple(sorted(defines.items())))
        if key not in modules:
            head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
            source, name = (SOURCE, "spmv_cluster") if kind == "cluster" else (HOT_X_SOURCE, "spmv_hot")
            image, _ = driver.nvrtc_compile(head + source, device_arch())
            modules[key] = driver.Module(image, name)
        return modules[key]

    def median_us(fn):  # the evaluator's timing: L2 flushed and the GPU kept busy before each run
        return kernel_us(fn, args.reps, warmup=3)

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": sys.argv, "matrices": []}
    for entry in entries:
        A = entry.load().tocsr()
        rows, cols = A.shape
        rowptr, col, val, x, ref, scale, cusparse = spmv_operands(A, median_us)
        nnz = col.numel()
        part_row, parts = nnz_split_parts(rowptr, col, A.shape, args.chunk)
        y = torch.zeros(rows, device="cuda")
        record = {"matrix": entry.name, "rows": rows, "cols": cols, "nnz": nnz, "cusparse_us": cusparse, "variants": []}
        print(f"{entry.name}: rows={rows} cols={cols} nnz={nnz} cuSPARSE {cusparse:.1f} us", flush=True)

        def measure(label, kernel, grid, block, smem, params):
            packed = driver.pack_params(params)

            def run():
                y.zero_()
                kernel.launch(grid, block, smem, stream, packed)

            run()
            torch.cuda.synchronize()
            error = float((y.double() - ref).abs().max()) / scale
            us = median_us(run)
            record["variants"].append({**label, "grid": grid, "block": block, "smem": smem, "us": us,
                                       "speedup": cusparse / us, "max_rel_error": error})
            print(f"  {label} grid={grid} block={block} smem={smem} {us:8.1f} us {cusparse / us:5.2f}x "
                  f"err={error:.1e}", flush=True)

        pointers = [ctypes.c_void_p(t.data_ptr()) for t in (rowptr, col, val, x, y, part_row)]
        for block, per_sm in ((256, 0), (512, 4)):  # the control: x gathered from global memory
            groups = math.ceil(parts / (block // 32))
            grid = groups if per_sm == 0 else min(sms * per_sm, groups)
            kernel = module("global", BLOCK=block, CHUNK=args.chunk, STREAM=0)
            measure({"kind": "global", "per_sm": per_sm}, kernel, grid, block, 0,
                    pointers + [ctypes.c_void_p(0)] + [ctypes.c_int(v) for v in (0, rows, nnz, parts)])
        for size in map(int, args.clusters.split(",")):
            slice_ = math.ceil(cols / size)
            if slice_ * 4 > MAX_SLICE_BYTES:
                print(f"  cluster={size}: x needs {slice_ * 4} bytes a block, over {MAX_SLICE_BYTES}")
                continue
            for block in (512, 1024):
                per_sm = max(1, min(2048 // block, MAX_SLICE_BYTES // (slice_ * 4 + 1024)))
                clusters = max(1, sms * per_sm // size)
                kernel = module("cluster", CLUSTER=size, BLOCK=block, CHUNK=args.chunk, SLICE=slice_)
                try:
                    measure({"kind": "cluster", "cluster": size, "slice": slice_}, kernel, clusters * size, block,
                            slice_ * 4, pointers + [ctypes.c_int(v) for v in (rows, cols, nnz, parts)])
                except Exception as exc:  # a cluster shape the device cannot run
                    print(f"  cluster={size} block={block}: {type(exc).__name__}: {exc}")
        results["matrices"].append(record)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
