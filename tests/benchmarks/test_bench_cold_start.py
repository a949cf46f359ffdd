"""The first-run (cold start) benchmark: its break-even rule, and a CPU run of one row whose
runtime specializes in the background with a slow fake specializer (timings meaningless here)."""

from __future__ import annotations

import json
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import torch
import torch._inductor.config

from helpers import load_benchmark

pytest.importorskip("torch_geometric")



def test_breakeven_is_where_the_run_stays_ahead_of_eager():
    breakeven = load_benchmark("bench_cold_start").breakeven
    # eager 2 ms, waited 1 ms, 3 ms epochs during the JIT and 1 ms after: 1+3+3+1+1 = 10 <= 5 * 2
    assert breakeven(0.001, [3, 3, 1, 1, 1, 1], [], 2.0) == 5
    assert breakeven(0.0, [1, 1, 1], [], 2.0) == 1
    assert breakeven(0.0, [1, 5, 1], [], 2.0) is None  # ahead after one epoch, then behind: 7 > 6 at the end
    assert breakeven(0.0, [1, 5, 1, 1], [], 2.0) == 4  # 8 <= 8
    assert breakeven(0.010, [1] * 12, [], 2.0) == 10  # 10 + j <= 2j from j = 10
    assert breakeven(5.0, [1] * 100, [], 2.0) is None  # 5 s is not repaid at 1 ms per epoch in 100 epochs
    # eager's own first epochs count as measured: after its slow start (9 ms, 5 ms), 10 + 2 <= 14
    assert breakeven(0.010, [1] * 12, [9, 5], 2.0) == 2
    assert breakeven(0.0, [], [], 2.0) is None


def test_eager_reference_brackets_the_compiled_runs():
    cold = load_benchmark("bench_cold_start")
    skipped = [100.0] * (cold.LOSS_EPOCHS - 1)  # eager's first epochs are not in its reference
    before = {"epoch_ms": 2.0, "epochs_ms": skipped + [2.0, 2.0, 2.0]}
    assert cold.eager_ms({"eager": before}) == 2.0  # rows from before the bracketing
    after = {"epoch_ms": 4.0, "epochs_ms": skipped + [4.0, 4.0]}
    assert cold.eager_ms({"eager": before, "eager_after": after}) == 2.0  # median of 2, 2, 2, 4, 4
    after["epochs_ms"] += [4.0, 4.0]
    assert cold.eager_ms({"eager": before, "eager_after": after}) == 4.0


def test_compare_lines_up_the_rows_of_repeated_runs(tmp_path):
    cold = load_benchmark("bench_cold_start")

    def row(graph, cold_ms):  # eager 2 ms; the cold run at cold_ms per epoch, losses equal
        eager = {"epoch_ms": 2.0, "epochs_ms": [2.0] * 30, "losses": [1.0]}
        run = {"epochs_ms": [cold_ms] * 30, "decided_after_epochs": 10, "decided_after_s": cold_ms,
               "steady_ms": cold_ms, "waited_s": 0.0, "losses": [1.0]}
        return {"graph": graph, "model": "gcn", "hidden": 128, "eager": eager, "cold": run}

    paths = []
    for i, rows in enumerate(([row("a", 1.0), row("b", 3.0)], [row("a", 1.0), row("b", 1.0), row("c", 1.0)])):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps({"env": {"gpu": "fake"}, "rows": rows}))
    text = cold.compare(paths)
    assert "Rows present in every run: 2" in text and "| c |" not in text  # c is not in run 1
    assert "| a | gcn | 128 | 1 | 1 |" in text and "| b | gcn | 128 | — | 1 |" in text
    assert "| **repaid within 10** | | | 1 of 2 | 2 of 2 |" in text
    assert "| b | gcn | 128 | 0.67× | 2.00× |" in text  # during the JIT, eager 2 ms over 3 ms / 1 ms
    assert "against eager measured over the run" not in text  # neither run timed eager over its span
    decided = text.split("## Decided after")[1].split("##")[0]
    assert "| b | gcn | 128 | 3.0 s | 1.0 s |" in decided and "| **median** | | | 2.0 s | 1.0 s |" in decided

    # a later run that timed eager over the cold run's span: the older one's cells say so, not "never"
    rows = [row("a", 1.0), row("b", 3.0)]
    for r in rows:
        r["eager_span"], r["eager_after"] = True, {"epochs_ms": [2.0] * 30}
    paths[1].write_text(json.dumps({"env": {"gpu": "fake"}, "rows": rows}))
    text = cold.compare(paths)
    measured = text.split("## Break-even epochs against eager measured over the run")[1].split("##")[0]
    assert "| a | gcn | 128 | not timed | 1 |" in measured and "| b | gcn | 128 | not timed | — |" in measured
    assert "| **repaid within 10** | | | not timed | 1 of 2 |" in measured


def test_slow_runs_are_found_with_their_excess_and_the_decisions_beside_them():
    cold = load_benchmark("bench_cold_start")
    epochs = [2.0] * 10 + [9.0, 5.0, 3.0, 2.0] + [2.0] * 10 + [6.0] + [2.0] * 5
    pending = [2] * 24 + [1] * 7  # a decision landed at index 24, next to the second run
    runs = cold.slow_runs(epochs, pending)
    assert [(r["epoch"], r["epochs"]) for r in runs] == [(10, 3), (24, 1)]
    assert runs[0]["excess_ms"] == pytest.approx(7 + 3 + 1) and runs[0]["at_s"] == pytest.approx(0.020)
    assert [r["decision"] for r in runs] == [False, True]
    assert cold.slow_runs([2.0] * 5) == [] and cold.slow_runs([]) == []


def test_break_even_against_eager_measured_over_the_run(tmp_path):
    cold = load_benchmark("bench_cold_start")
    # eager 2 ms a step; the cold run 1 ms, stalled 100 ms at its epoch 50 (a host's stall), and
    # eager's second run stalled as long at its epoch 11, the 41st of the two end to end
    before = {"epoch_ms": 2.0, "epochs_ms": [2.0] * 30, "losses": [1.0]}
    after = {"epoch_ms": 2.0, "epochs_ms": [2.0] * 10 + [102.0] + [2.0] * 130}
    run = {"epochs_ms": [1.0] * 49 + [101.0] + [1.0] * 100, "decided_after_epochs": 10, "steady_ms": 1.0,
           "waited_s": 0.0, "losses": [1.0], "all_decided": True, "decided_after_s": 0.01, "first_epoch_s": 5.0,
           "kernels": {"A spmm n=128 float32": "installed: fake"}}
    row = {"graph": "g", "model": "gcn", "hidden": 128, "eager": before, "cold": run, "eager_after": after}
    assert cold.row_metrics(row)["breakeven_epochs"] == 100  # j + 100 <= 2 j: behind from 50 to 99
    assert cold.row_metrics(row)["breakeven_measured_epochs"] is None  # rows before eager_span
    row["eager_span"] = True
    assert cold.row_metrics(row)["breakeven_measured_epochs"] == 1  # eager met its stall first
    run["epochs_ms"][20] += 100.0  # a second stall of the cold run: j + 200 <= 2 j + 100 from 100
    assert cold.row_metrics(row)["breakeven_measured_epochs"] == 100
    run["epochs_ms"][20] -= 100.0
    doc = {"env": {"gpu": "fake"}, "rows": [row], "runs": []}
    text = cold.markdown(doc)
    assert "| vs eager measured over the run |" in text and "| 100 | 1 |" in text
    assert "Repaid within 10 epochs: 0 of 1 rows (1 of 1 against eager's epochs measured" in text
    assert "| control |" not in text and "off_breakeven_epochs" not in cold.row_metrics(row)

    # the control: the runtime-off run, as long as the cold run, by the same rule; it stalls
    # 100 ms at its epoch 30: j + 100 <= 2 j from 100, and against eager measured over the run
    # (stalled as long at its 41st) from 41
    row["off"] = {"first_epoch_s": 5.0, "epoch_ms": 1.0, "epochs_ms": [1.0] * 29 + [101.0] + [1.0] * 120}
    row["off_span"] = True
    m = cold.row_metrics(row)
    assert m["off_breakeven_epochs"] == 100 and m["off_breakeven_measured_epochs"] == 41
    row["off"]["epochs_ms"][29] = 1.0
    m = cold.row_metrics(row)
    assert m["off_breakeven_epochs"] == 1 and m["off_breakeven_measured_epochs"] == 1
    text = cold.markdown(doc)
    assert "| control |" in text and "| 100 | 1 | 1 / 1 |" in text
    assert "; the control, 1 of 1 (1 against eager measured over the run)" in text
    compared = tmp_path / "a.json"
    compared.write_text(json.dumps(doc))
    text = cold.compare([compared, compared])
    control = text.split("## Control: the runtime-off run by the same rule")[1].split("##")[0]
    assert "| g | gcn | 128 | 1 | 1 |" in control and "| **repaid within 10** | | | 1 of 1 | 1 of 1 |" in control


class SlowSpecializer:
    """Decides a key once ``ready()`` says so (polled, as a specializer waits on its sandbox),
    with a kernel that computes the product densely."""

    def __init__(self):
        self.keys, self.ready, self.waited_s = [], None, 0.0
        self.policy_id = "fake"

    def __call__(self, key, crow, col, ncols):
        from torch_sparserl.jit.cache import CacheEntry

        started = time.perf_counter()
        while not self.ready() and time.perf_counter() - started < 60:
            time.sleep(0.005)
        self.waited_s += time.perf_counter() - started
        self.keys.append(f"{key.op} n={key.n}")
        return CacheEntry(key, "// fake\n", family="dense", params={}, reason="fake")

    @staticmethod
    def installer(entry, crow, col, ncols):
        rows = crow.numel() - 1

        def launch(crow, col, val, X):
            return torch.sparse_csr_tensor(crow.to(torch.int64), col.to(torch.int64), val, (rows, ncols)).to_dense() @ X

        return launch


@pytest.mark.slow
@pytest.mark.parametrize("off_first", [False, True])
@torch._inductor.config.patch(force_disable_caches=True)
def test_a_cold_row_on_the_cpu_takes_the_kernels_over_in_the_background(tmp_path, monkeypatch, off_first):
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    cold = load_benchmark("bench_cold_start")
    gnn = load_benchmark("common.gnn")
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    specializer = SlowSpecializer()
    runtime = rt.Runtime(JitOptions(mode="background"), cache=KernelCache(tmp_path / "cache"),
                         specializer=specializer, installer=specializer.installer, devices=("cpu",))
    # the kernel arrives after a few epochs served by the fallback (4 products per epoch)
    specializer.ready = lambda: runtime.stats["fallback_calls"] >= 4 * 4
    previous = rt.active_or_none()
    graph = gnn.prepare_graph("cora", torch.device("cpu"))
    try:
        row = cold.measure_row("cora", "gcn", 16, "cpu", after=5, max_s=60, eager_epochs=25, graph=graph,
                               runtime=runtime, off_first=off_first)
    finally:
        rt.set_active(previous)
        runtime.close()
    c = row["cold"]
    # layers 1 and 2 multiply by A (n=16 hidden, n=16 classes), the backward by Aᵀ; GCN's
    # adjacency is symmetric, so Aᵀ's key is found in the cache under A's fingerprint
    assert specializer.keys == ["spmm n=16"], specializer.keys
    assert c["all_decided"] and c["decided_after_epochs"] >= 1, c  # served by the fallback meanwhile
    assert c["pending"][0] >= 1 and c["pending"][-1] == 0
    assert all(v.startswith("installed: dense") for v in c["kernels"].values()) and len(c["kernels"]) == 2
    assert c["stats"]["installed_calls"] > 0 and c["stats"]["fallback_calls"] > 0
    assert c["waited_s"] < specializer.waited_s  # the loop never waited for the specialization
    assert len(c["epochs_ms"]) >= c["decided_after_epochs"] + 5 and len(c["losses"]) == cold.LOSS_EPOCHS
    assert row["losses_equal"], row["loss_rel_diff"]
    assert row["off"]["first_epoch_s"] > 0 and row["steady_speedup_vs_eager"] > 0
    assert row["order"] == ["eager"] + ["off"] * off_first + ["cold", "off", "eager"]
    assert ("off_first" in row) == off_first and row["eager_ms"] == cold.eager_ms(row)
    assert row["off_span"] and len(row["off"]["epochs_ms"]) == max(3 * cold.LOSS_EPOCHS - 1, len(c["epochs_ms"]))
    assert "off_breakeven_measured_epochs" in row

    doc = {"env": {"gpu": None}, "runs": [{"command": "test", "started": "now"}], "rows": [row]}
    path = tmp_path / "cold.json"
    cold.save(doc, path)
    md = path.with_suffix(".md").read_text()
    assert "| cora | gcn | 16 |" in md and "2 of 2 installed" in md
    assert ("(`--off-first`)" in md) == off_first
    picture = ET.fromstring(path.with_suffix(".svg").read_text())
    assert [e.get("id") for e in picture.iter() if (e.get("id") or "").startswith("row-")] == ["row-0"]
    assert cold.main(["--report", str(path)]) == 0


def test_the_background_thread_does_not_hold_the_loop(tmp_path):
    """The specializer's thread sleeps (as it does waiting on the sandbox or a build): calls
    return at once, served by the fallback."""
    from torch_sparserl import pattern as patterns
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    gate = threading.Event()

    def specializer(key, crow, col, ncols):
        gate.wait(10)
        raise RuntimeError("no kernel")

    runtime = rt.Runtime(JitOptions(mode="background"), cache=KernelCache(tmp_path), specializer=specializer,
                         devices=("cpu",))
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    entry = patterns.lookup(crow, col, 2)
    started = time.perf_counter()
    assert runtime.call("spmm", entry, crow, col, torch.ones(2), torch.ones(2, 3)) is None
    assert time.perf_counter() - started < 5
    gate.set()
    runtime.wait(10)
    runtime.close()
