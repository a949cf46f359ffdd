"""Is a compiled CSRMatrix training step on a small graph bound by the GPU or by the CPU?

On pubmed (N=128, CUDA): ``mean(square(A @ x))`` compiled with the sparserl backend, forward +
backward, timed per step pipelined and synchronized after each step, against the time its
kernels take on the GPU (profiler, CUDA activity); the installed kernels; and what an output
allocation costs with and without the zero-fill that plans with ``init=zero`` need. Writes
``$OUT/zero_probe.json`` (with the profiler's kernel table after it).

    OUT=/tmp python benchmarks/profile_compiled_step.py
"""
import sys, time, statistics, json, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import bench_gnn as bench
from torch_sparserl import runtime as rt, intercept

dev = torch.device("cuda")
graph = bench.prepare_graph("pubmed", dev)
on = rt.configure(mode="sync")
A = graph["csr_matrix_gcn"]; n = graph["n"]
X = torch.randn(n, 128, device=dev, requires_grad=True)
A @ X.detach()
def us(f, k=300, reps=7, sync_each=False):
    for _ in range(30): f()
    torch.cuda.synchronize(); v = []
    for _ in range(reps):
        s = time.perf_counter()
        for _ in range(k):
            f()
            if sync_each: torch.cuda.synchronize()
        torch.cuda.synchronize(); v.append((time.perf_counter() - s) / k * 1e6)
    return round(statistics.median(v), 1)
def gpu_us(f, k=300):
    for _ in range(30): f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(k): f()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages()) / k  # us of kernels per step
    return round(total, 1), prof.key_averages().table(sort_by="device_time_total", row_limit=12)
res = {}
fn = lambda x: (A @ x).square().mean()
c = torch.compile(fn, backend="sparserl"); c(X).backward(); intercept.deactivate_backend()
step = lambda: c(X).backward()
res["compiled step pipelined"] = us(step)
res["compiled step sync each"] = us(step, sync_each=True)
res["compiled step kernels (GPU us)"], table = gpu_us(step)
shape = (n, 128)
Y = X.detach()
res["new_zeros"] = us(lambda: Y.new_zeros(shape), k=1000)
res["new_empty"] = us(lambda: Y.new_empty(shape), k=1000)
res["empty+zero_"] = us(lambda: Y.new_empty(shape).zero_(), k=1000)
res["decisions"] = on.decisions(A.crow, A.col, A.shape[1])
print(json.dumps(res, indent=1)); print(table)
Path(os.environ.get("OUT", "/tmp"), "zero_probe.json").write_text(json.dumps(res, indent=1) + "\n" + table)
