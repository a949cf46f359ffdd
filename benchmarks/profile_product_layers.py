"""What one sparse product costs in a training step, layer by layer (pubmed, N=128, CUDA).

One function, ``loss = mean(square(product(x)))`` with ``x`` requiring grad, timed as forward +
backward (CPU-bound at this size) in four forms: a dense ``x @ W`` (the floor); a trivial
``torch.library.custom_op`` matmul (what custom_op's machinery costs); the sparserl operator
on the matrix's parts; and ``A @ x`` on a CSRMatrix (the subclass on top). Each runs eagerly
and compiled with the sparserl backend, and the sparse ones compiled with the runtime off
(cuSPARSE) and with ``direct_ops`` off (custom_op's layers kept in the compiled graphs).
Writes ``$OUT/where.json``, and in ``$OUT/where-profile.txt`` a profiler table and the Python
functions of a compiled CSRMatrix step by their own time.

    OUT=/tmp python benchmarks/profile_product_layers.py
"""
import cProfile, io, json, os, pstats, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import bench_gnn as bench
from torch_sparserl import runtime as rt, intercept

dev = torch.device("cuda")
graph = bench.prepare_graph("pubmed", dev)
on = rt.configure(mode="sync")
off = rt.Runtime(rt.RuntimeSettings(mode="off"))
A = graph["csr_matrix_gcn"]; n = graph["n"]
crow, col, val = A.crow, A.col, A.val
X = torch.randn(n, 128, device=dev, requires_grad=True)
W = torch.randn(128, 128, device=dev)
A @ X.detach()

@torch.library.custom_op("scratch::mm", mutates_args=())
def cmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w
@cmm.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[1]))
def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
def _bwd(ctx, g):
    (w,) = ctx.saved_tensors
    return cmm(g, w.t().contiguous()), None
cmm.register_autograd(_bwd, setup_context=_setup)

def us(f, k=300, reps=9):
    for _ in range(30): f()
    torch.cuda.synchronize(); v = []
    for _ in range(reps):
        s = time.perf_counter()
        for _ in range(k): f()
        torch.cuda.synchronize(); v.append((time.perf_counter() - s) / k * 1e6)
    return round(statistics.median(v), 1)

fns = {
    "dense": lambda x: (x @ W).square().mean(),
    "custom_op mm": lambda x: cmm(x, W).square().mean(),
    "sparserl op (parts)": lambda x: torch.ops.sparserl.spmm(crow, col, val, n, x).square().mean(),
    "CSRMatrix A @ x": lambda x: (A @ x).square().mean(),
}
res = {}
for name, fn in fns.items():
    res[f"eager {name}"] = us(lambda: fn(X).backward())
    c = torch.compile(fn, backend="sparserl")
    c(X).backward()
    intercept.deactivate_backend()
    res[f"compiled {name}"] = us(lambda: c(X).backward())
    with torch.no_grad():
        res[f"compiled no_grad fwd {name}"] = us(lambda: c(X))
    if "sparserl" in name or "CSR" in name:
        rt.set_active(off)
        res[f"compiled {name} (runtime off)"] = us(lambda: c(X).backward())
        rt.set_active(on)
        torch._dynamo.reset()
        c = torch.compile(fn, backend="sparserl", options={"direct_ops": False})
        c(X).backward()
        intercept.deactivate_backend()
        res[f"compiled {name} (direct_ops off)"] = us(lambda: c(X).backward())
    torch._dynamo.reset()
    print(json.dumps(res, indent=1), flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    c = torch.compile(fns["sparserl op (parts)"], backend="sparserl"); c(X).backward()
    for _ in range(50): c(X).backward()
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
# Python functions of the compiled CSRMatrix step, by own time: where the CPU goes around the products
torch._dynamo.reset()
c = torch.compile(fns["CSRMatrix A @ x"], backend="sparserl"); c(X).backward()
intercept.deactivate_backend()
for _ in range(30): c(X).backward()
profiler = cProfile.Profile()
profiler.enable()
for _ in range(500): c(X).backward()
torch.cuda.synchronize()
profiler.disable()
stream = io.StringIO()
pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(45)
Path(os.environ.get("OUT", "/tmp"), "where-profile.txt").write_text(table + "\n\ncProfile, 500 compiled CSRMatrix steps:\n" + stream.getvalue())
Path(os.environ.get("OUT", "/tmp"), "where.json").write_text(json.dumps(res, indent=1))
