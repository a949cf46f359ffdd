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

    python benchmarks/probes/probe_hot_x.py rmat-s20-ef16,uk-2007-05_100000,fb100_Cornell5 --out results.json

Needs a CUDA GPU; the matrices are named as the benchmarks name them (``common.known_matrices``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the common core

from common import kernel_us, known_matrices  # noqa: E402
from common.spmv_probe import HOT_X_SOURCE, nnz_split_parts, spmv_operands  # noqa: E402

# (H, block, blocks per SM, stream); blocks per SM 0: one block per chunk group, not persistent
VARIANTS = [(0, 256, 0, 0), (0, 256, 0, 1), (0, 512, 4, 0), (6144, 512, 4, 0), (12288, 512, 4, 0),
            (12288, 512, 4, 1), (12288, 1024, 2, 0), (24576, 1024, 2, 0), (24576, 512, 2, 0),
            (49152, 1024, 1, 0), (49152, 1024, 1, 1)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("matrices", help="comma-separated names of known matrices")
    parser.add_argument("--chunks", default="128,256", help="nonzeros per warp chunk, comma-separated")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write the timings as JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        parser.error("probe_hot_x launches GPU kernels: no CUDA device here")
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
            image, _ = driver.nvrtc_compile(head + HOT_X_SOURCE, device_arch())
            modules[block, chunk, stream] = driver.Module(image, "spmv_hot")
        return modules[block, chunk, stream]

    def median_us(fn):  # the evaluator's timing: L2 flushed and the GPU kept busy before each run
        return kernel_us(fn, args.reps, warmup=3)

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
