"""``ts.capture_step`` on the CPU: its arguments, the eager CPU path, and, with the CUDA graph
machinery faked (:class:`FakeGraphs`), when it warms up, captures, replays and captures again."""

from __future__ import annotations

import gc
import math
import threading
import weakref

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl.config import JitOptions
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.data.buckets import Buckets
from torch_sparserl.data.sampling import neighbor_batches
from torch_sparserl.train import CapturedStep, CapturedSteps, capture_step
from torch_sparserl.train.capture import MAX_SHAPES, MAX_WARMUP

from fakes import Fakes
from helpers import padded_batch_step

HIDDEN, CLASSES, FEATURES = 8, 4, 6


class FakeGraph:
    """A captured step on the CPU. Its capture ran the step (a CUDA capture only records it), so
    its first replay runs nothing: the capturing call is one step, as on a GPU. Later replays run
    the step on the capture's inputs and write its outputs into the capture's own tensors, as a
    CUDA graph's replay rewrites its outputs in place."""

    def __init__(self, step, inputs, outputs):
        self.step, self.inputs, self.outputs = step, inputs, outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        if self.replays == 1:
            return
        new = self.step(*self.inputs)
        with torch.no_grad():
            for kept, fresh in zip(_leaves(self.outputs), _leaves(new)):
                kept.copy_(fresh)


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


class FakeGraphs:
    """The CUDA graph machinery of a step, on the CPU (``device_type = "cpu"``)."""

    device_type = "cpu"

    def __init__(self, fail: Exception | None = None):
        self.warmed, self.graphs, self.fail = 0, [], fail

    def available(self):
        return True

    def warm(self, step, inputs, device):
        self.warmed += 1
        return step(*inputs)

    def capture(self, step, inputs, device):
        if self.fail is not None:
            raise self.fail
        out = step(*inputs)
        self.graphs.append(FakeGraph(step, inputs, out))
        return self.graphs[-1], out


def adjacency(n: int = 40, seed: int = 0) -> sp.csr_matrix:
    """A symmetric normalized adjacency with self loops, ``D^-1/2 (A + I) D^-1/2``, float64."""
    A = sp.random(n, n, density=0.1, format="csr", random_state=np.random.default_rng(seed))
    A = ((A + A.T) > 0).astype(np.float64) + sp.identity(n, format="csr")
    scale = sp.diags(1.0 / np.sqrt(np.asarray(A.sum(axis=1)).ravel()))
    return (scale @ A @ scale).tocsr()


class Task:
    """A two-layer GCN trained with Adam on fresh random data, in ``dtype``; ``product(h)`` is
    the adjacency product. ``step(x, y)`` is one training step returning the loss (detached)."""

    def __init__(self, n: int, product, dtype=torch.float64, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64).to(dtype)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.w1 = torch.nn.Parameter(0.3 * torch.randn(FEATURES, HIDDEN, generator=g, dtype=torch.float64).to(dtype))
        self.w2 = torch.nn.Parameter(0.3 * torch.randn(HIDDEN, CLASSES, generator=g, dtype=torch.float64).to(dtype))
        self.opt = torch.optim.Adam([self.w1, self.w2], lr=0.05)
        self.product = product

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        h = torch.relu(self.product(x @ self.w1))
        loss = torch.nn.functional.cross_entropy(self.product(h @ self.w2), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


def reference_losses(M: sp.csr_matrix, steps: int) -> torch.Tensor:
    """The float64 reference: the same training with the adjacency as a dense float64 matrix."""
    dense = torch.from_numpy(M.toarray())
    task = Task(M.shape[0], lambda h: dense @ h)
    return torch.stack([task.step(task.x, task.y) for _ in range(steps)])


@pytest.fixture
def using():
    """``using(runtime)``: make ``runtime`` the active one for the test; restored and closed after."""
    made = []
    previous = rt.active_or_none()

    def use(runtime):
        made.append(runtime)
        rt.set_active(runtime)
        return runtime

    yield use
    rt.set_active(previous)
    for runtime in made:
        runtime.close()


def fake_runtime(tmp_path, mode="sync", gate=None, **settings):
    fakes = Fakes(gate=gate)
    runtime = rt.Runtime(JitOptions(mode=mode, **{"admit_age_s": 0, **settings}), cache=KernelCache(tmp_path),
                         specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    return runtime, fakes


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("kwargs, message", [
    ({"warmup": 0}, "warmup must be a whole number of calls from 1 to 1000 (got 0)"),
    ({"warmup": MAX_WARMUP + 1}, "(got 1001)"),
    ({"warmup": 2.0}, "(got 2.0)"),
    ({"warmup": True}, "(got True)"),
    ({"wait_s": -1}, "wait_s must be a number of seconds from 0 to 3600 (got -1)"),
    ({"wait_s": math.nan}, "(got nan)"),
    ({"wait_s": "1"}, "(got '1')"),
])
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match="capture_step: ") as info:
        capture_step(lambda: None, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("max_shapes", [0, MAX_SHAPES + 1, True, 2.0, "2"])
def test_bad_max_shapes_are_refused_by_name(max_shapes):
    with pytest.raises(ValueError, match=rf"capture_step: max_shapes must be a whole number from 1 to {MAX_SHAPES} "
                                         rf"\(got {max_shapes!r}\)"):
        capture_step(lambda x: x, max_shapes=max_shapes)


def test_one_graph_per_signature_up_to_max_shapes():
    graphs = FakeGraphs()
    step = CapturedSteps(lambda a, b: a * 2 + b, warmup=1, max_shapes=2, graphs=graphs)
    assert isinstance(capture_step(lambda a: a, max_shapes=2), CapturedSteps)
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        for rows in (3, 5):
            a, b = torch.randn(rows, 2, generator=generator), torch.randn(rows, 2, generator=generator)
            torch.testing.assert_close(step(a, b), a * 2 + b, rtol=0, atol=0)
    assert step.captures == 2 and step.captured == 2 and len(graphs.graphs) == 2 and not step.eager
    with pytest.raises(ValueError, match=r"captured for 2 argument signatures, max_shapes=2; this call's "
                                         r"\(\(4, 2\) torch.float32, \(4, 2\) torch.float32\) would be one more"):
        step(torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(TypeError, match=r"argument 1 is a int"):
        step(torch.zeros(3, 2), 1)


def test_padded_mini_batches_train_as_eagerly_with_a_graph_per_bucket():
    """A GraphSAGE-like step over neighbour-sampled batches padded to two buckets, its matrix
    built inside the step from the padded (crow, col, val) arguments: the losses are the eager
    loop's, batch by batch, with one capture per bucket."""
    adjacency = sp.random(120, 120, density=0.05, format="csr", random_state=np.random.default_rng(4))
    adjacency = ((adjacency + adjacency.T) > 0).astype(np.float64).tocsr()
    batches = list(neighbor_batches(adjacency, 16, [4, 3], seed=2))
    buckets = Buckets.fit(batches, count=2)
    features = torch.randn(120, FEATURES, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (120,), generator=torch.Generator().manual_seed(6))

    def run(capture: bool):
        weight = torch.nn.Parameter(0.3 * torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7),
                                                      dtype=torch.float64))
        opt = torch.optim.Adam([weight], lr=0.05)

        step = padded_batch_step(weight, opt)

        stepper = CapturedSteps(step, warmup=1, max_shapes=4, graphs=FakeGraphs()) if capture else step
        losses = []
        for _ in range(3):
            for batch in map(buckets.pad, batches):
                crow, col, val = batch.parts()
                seeds = (torch.arange(batch.shape[0]) < batch.seeds).to(torch.float64)
                nodes = torch.from_numpy(batch.nodes).long()
                losses.append(stepper(features[nodes], labels[nodes[: batch.shape[0]]], crow, col,
                                      val.to(torch.float64), seeds).clone())
        return torch.stack(losses), stepper

    want, _ = run(False)
    got, stepper = run(True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert stepper.captures == len({(b.shape, b.nnz) for b in map(buckets.pad, batches)}) <= 2


def test_a_step_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"capture_step: step_fn must be callable \(got int\)"):
        capture_step(3)


def test_bad_arguments_and_outputs_are_refused_by_name():
    x = torch.randn(3)
    with pytest.raises(TypeError, match="capture_step: the step's arguments must be tensors .argument 1 is a int"):
        capture_step(lambda a, b: a)(x, 2)
    with pytest.raises(ValueError, match="capture_step: argument 0 requires grad"):
        capture_step(lambda a: a * 2)(torch.randn(3, requires_grad=True))
    with pytest.raises(TypeError, match=r"capture_step: the step must return tensors .* float at the output\[1\]"):
        capture_step(lambda a: (a, a.sum().item()))(x)


# ------------------------------------------------------------------ the CPU path


def test_on_the_cpu_the_step_runs_eagerly_with_the_eager_losses():
    """The same script on the CPU: every call runs the step, losses equal the eager loop's and
    the float64 reference's."""
    M = adjacency()
    A = ts.csr(M, dtype=torch.float64)
    eager, captured = Task(M.shape[0], lambda h: A @ h), Task(M.shape[0], lambda h: A @ h)
    step = ts.capture_step(captured.step)
    want = torch.stack([eager.step(eager.x, eager.y) for _ in range(6)])
    got = torch.stack([step(captured.x, captured.y).clone() for _ in range(6)])
    assert step.eager and not step.captured and step.captures == 0
    assert torch.equal(got, want)
    assert_close_to_reference(got, reference_losses(M, 6), torch.float64)


# ------------------------------------------------------------------ warm-up, capture, replay


def test_warms_up_then_captures_then_replays_with_the_reference_losses():
    M = adjacency()
    A = ts.csr(M, dtype=torch.float64)
    task = Task(M.shape[0], lambda h: A @ h)
    graphs = FakeGraphs()
    step = CapturedStep(task.step, warmup=3, graphs=graphs)
    losses = []
    for call in range(8):
        losses.append(step(task.x, task.y).clone())
        assert graphs.warmed == min(call + 1, 3) and len(graphs.graphs) == (call >= 3)
    out = step(task.x, task.y)
    assert out is step(task.x, task.y)  # a replay returns the graph's own tensors, overwritten by the next
    assert step.captured and step.captures == 1 and graphs.graphs[0].replays == 7
    assert_close_to_reference(torch.stack(losses), reference_losses(M, 8), torch.float64)


def test_new_inputs_are_copied_into_the_captured_ones():
    graphs = FakeGraphs()
    step = CapturedStep(lambda a, b: a * 2 + b, warmup=1, graphs=graphs)
    step(torch.ones(4), torch.zeros(4))
    step(torch.ones(4), torch.zeros(4))  # captured
    x = torch.randn(4, dtype=torch.float64).float()
    torch.testing.assert_close(step(x, torch.full((4,), 3.0)), x * 2 + 3, rtol=0, atol=0)


def test_inputs_of_another_shape_dtype_or_number_are_refused():
    step = CapturedStep(lambda a: a + 1, warmup=1, graphs=FakeGraphs())
    for _ in range(2):
        step(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"capture_step: argument 0 must be a tensor of shape \(3, 2\), "
                                         r"torch.float32, on cpu, as when the step was captured "
                                         r"\(got shape \(2, 3\), torch.float32, cpu\)"):
        step(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"got shape \(3, 2\), torch.float64, cpu"):
        step(torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"captured with 1 argument\(s\); this call gave 2"):
        step(torch.zeros(3, 2), torch.zeros(1))
    assert step.captures == 1 and torch.equal(step(torch.ones(3, 2)), torch.full((3, 2), 2.0))


def test_a_failed_capture_says_what_a_step_must_do():
    step = CapturedStep(lambda a: a + 1, warmup=1, graphs=FakeGraphs(fail=RuntimeError("operation not permitted")))
    step(torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"capture_step: capturing the step as a CUDA graph failed \(RuntimeError: "
                                           r"operation not permitted\).*capturable=True"):
        step(torch.zeros(2))
    assert not step.captured


# ------------------------------------------------------------------ the runtime's decisions


def test_a_decision_landing_after_the_capture_captures_again(tmp_path, using):
    """Captured while the decisions were pending (cuSPARSE's products), captured again once they
    landed: the kernels serve the steps after, and the losses stay the reference's."""
    gate = threading.Event()
    runtime, fakes = fake_runtime(tmp_path, mode="background", gate=gate)
    using(runtime)
    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    task = Task(M.shape[0], lambda h: A @ h, torch.float32)
    step = CapturedStep(task.step, warmup=2, graphs=FakeGraphs())
    losses = [step(task.x, task.y).clone() for _ in range(3)]
    assert step.captures == 1 and fakes.launched == []  # pending: captured with torch's products
    epoch = runtime.epoch
    gate.set()
    runtime.wait(10)
    assert runtime.epoch > epoch  # the decisions landed
    losses += [step(task.x, task.y).clone() for _ in range(2)]
    assert step.captures == 1  # warming up again
    losses.append(step(task.x, task.y).clone())
    assert step.captures == 2 and fakes.launched  # captured with the kernels
    losses += [step(task.x, task.y).clone() for _ in range(2)]
    assert step.captures == 2
    assert_close_to_reference(torch.stack(losses), reference_losses(M, 8), torch.float32)


def test_a_decision_landing_while_the_step_is_captured_captures_again(tmp_path, using):
    """The graph may hold the vendor's product (the decision was pending when the capture read
    it): the kernel installed meanwhile is captured on the next call's round."""
    gate = threading.Event()
    runtime, fakes = fake_runtime(tmp_path, mode="background", gate=gate)
    using(runtime)

    class Landing(FakeGraphs):
        def capture(self, step, inputs, device):
            graph = super().capture(step, inputs, device)
            gate.set()
            runtime.wait(10)
            return graph

    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    step = CapturedStep(lambda x: A @ x, warmup=1, graphs=Landing())
    x = torch.randn(M.shape[1], 3)
    for _ in range(2):
        step(x)
    assert step.captures == 1 and fakes.specialized
    for _ in range(2):
        step(x)
    assert step.captures == 2


def test_a_step_without_tensors_runs_eagerly_with_a_warning():
    calls = []
    step = CapturedStep(lambda: calls.append(1), warmup=1, graphs=FakeGraphs())
    with pytest.warns(UserWarning, match="capture_step: the step's tensors are on no tensor argument or output; "
                                         "it runs eagerly"):
        step()
    for _ in range(3):
        step()
    assert step.eager and step.captures == 0 and len(calls) == 4


def test_an_epoch_that_moved_for_nothing_the_graph_launches_replays(tmp_path, using):
    runtime, _ = fake_runtime(tmp_path)
    using(runtime)
    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    step = CapturedStep(lambda x: A @ x, warmup=1, graphs=FakeGraphs())
    x = torch.randn(M.shape[1], 3)
    for _ in range(2):
        step(x)
    runtime.invalidate()  # moves the epoch; every state stays what it was
    torch.testing.assert_close(step(x), torch.from_numpy(M @ x.double().numpy()).float())
    assert step.captures == 1


@pytest.mark.parametrize("settings", [{"admit_calls": 2}, {"mode": "background", "admit_age_s": 60.0}],
                         ids=["admit_calls", "young"])
def test_a_matrix_built_inside_the_step_does_not_hold_the_capture_back(tmp_path, using, settings):
    """Mini-batches whose matrix the step builds from its arguments: each call's pattern is new,
    so its product is never admitted (``admit_calls``) or always young (``admit_age_s``). That
    is no reason to warm up on (the graph serves such a pattern by cuSPARSE whatever is decided):
    each bucket is captured after its ``warmup`` calls, and the losses are the eager loop's."""
    runtime, _ = fake_runtime(tmp_path, **settings)
    using(runtime)
    adjacency = sp.random(120, 120, density=0.05, format="csr", random_state=np.random.default_rng(4))
    adjacency = ((adjacency + adjacency.T) > 0).astype(np.float64).tocsr()
    batches = list(neighbor_batches(adjacency, 16, [4, 3], seed=2))
    buckets = Buckets.fit(batches, count=2)
    padded = [buckets.pad(batch) for batch in batches]
    features = torch.randn(120, FEATURES, generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, CLASSES, (120,), generator=torch.Generator().manual_seed(6))

    def run(capture: bool):
        weight = torch.nn.Parameter(0.3 * torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7)))
        step = padded_batch_step(weight, torch.optim.Adam([weight], lr=0.05))
        stepper = CapturedSteps(step, warmup=2, max_shapes=4, graphs=FakeGraphs()) if capture else step
        losses = []
        for _ in range(3):
            for batch in padded:
                crow, col, val = batch.parts()
                seeds = (torch.arange(batch.shape[0]) < batch.seeds).float()
                nodes = torch.from_numpy(batch.nodes).long()
                losses.append(stepper(features[nodes], labels[nodes[: batch.shape[0]]], crow, col, val,
                                      seeds).clone())
        return torch.stack(losses), stepper

    want, _ = run(False)
    undecided = runtime.stats["unadmitted_calls"] + runtime.stats["young_calls"]
    got, stepper = run(True)
    assert runtime.stats["unadmitted_calls"] + runtime.stats["young_calls"] > undecided  # none was decided
    assert stepper.captures == stepper.captured == len({(b.shape, b.nnz) for b in padded}) == 2
    assert runtime.stats["unasked_kept"] == 0
    assert_close_to_reference(got, want, torch.float32)


def test_products_not_yet_admitted_keep_the_step_warming_up(tmp_path, using):
    """admit_calls=4: the first three calls decide nothing; the step warms up until a call has
    asked for every product, and is captured with the kernels."""
    runtime, fakes = fake_runtime(tmp_path, admit_calls=4)
    using(runtime)
    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    task = Task(M.shape[0], lambda h: A @ h, torch.float32)
    step = CapturedStep(task.step, warmup=1, graphs=FakeGraphs())
    for _ in range(4):
        step(task.x, task.y)
    records = [record.state for _, record in runtime.records()]
    assert step.captures == 0 and len(records) == 4  # A and Aᵀ, two widths each
    assert all(isinstance(state, rt.Installed) for state in records)
    step(task.x, task.y)
    assert step.captures == 1


def test_wait_s_waits_for_the_pending_decisions_before_capturing(tmp_path, using):
    gate = threading.Event()
    runtime, fakes = fake_runtime(tmp_path, mode="background", gate=gate)
    using(runtime)
    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    task = Task(M.shape[0], lambda h: A @ h, torch.float32)
    step = CapturedStep(task.step, warmup=1, wait_s=10, graphs=FakeGraphs())
    step(task.x, task.y)  # warm: the decisions are queued
    threading.Timer(0.2, gate.set).start()
    step(task.x, task.y)  # waits for them; they landed: one more warm-up with the kernels
    assert step.captures == 0 and fakes.launched
    step(task.x, task.y)
    runtime.wait(10)
    for _ in range(2):
        step(task.x, task.y)
    assert step.captures == 1  # the first graph had the kernels: nothing to capture again


def test_another_active_runtime_captures_again_and_a_closed_one_is_never_replayed(tmp_path, using):
    runtime, _ = fake_runtime(tmp_path / "first")
    using(runtime)
    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    step = CapturedStep(lambda x: A @ x, warmup=1, graphs=FakeGraphs())
    x = torch.randn(M.shape[1], 3)
    for _ in range(2):
        step(x)
    other, _ = fake_runtime(tmp_path / "second")
    using(other)
    step(x)  # warms up under the other runtime
    assert step.captures == 1
    torch.testing.assert_close(step(x), torch.from_numpy(M @ x.double().numpy()).float())
    assert step.captures == 2
    other.close()  # and still the active one
    with pytest.raises(RuntimeError, match=r"capture_step: the JIT runtime the step was captured under was closed "
                                           r"\(Runtime.close\) and is still the active one"):
        step(x)


def test_a_live_graph_keeps_the_kernels_it_may_launch(tmp_path, using):
    """A kernel the graph may launch lives while the graph does, though its record now holds
    another state (a CUDA graph would launch it), and no longer once the step is captured again."""
    runtime, _ = fake_runtime(tmp_path / "first")
    using(runtime)
    M = adjacency()
    crow, col = (torch.from_numpy(M.indptr.astype(np.int64)), torch.from_numpy(M.indices.astype(np.int64)))
    val = torch.from_numpy(M.data).float()
    step = CapturedStep(lambda x: torch.ops.sparserl.spmm(crow, col, val, M.shape[1], x), warmup=1, graphs=FakeGraphs())
    x = torch.randn(M.shape[1], 3)
    for _ in range(2):
        step(x)
    ((_, record),) = runtime.records()
    assert isinstance(record.state, rt.Installed)
    kernel = weakref.ref(record.state.launch)
    runtime._decisions.set(record, rt.Fallback(None, "replaced by the test"))  # a kernel replaced
    gc.collect()
    assert kernel() is not None
    step(x)  # no kernel to capture again with: replayed
    assert step.captures == 1 and kernel() is not None
    other, _ = fake_runtime(tmp_path / "second")
    using(other)
    for _ in range(2):
        step(x)  # warm-up, then captured under the other runtime
    gc.collect()
    assert step.captures == 2 and kernel() is None


def test_another_matrix_argument_captures_again(tmp_path, using):
    runtime, _ = fake_runtime(tmp_path)
    using(runtime)
    M = adjacency()
    A = ts.csr(M, dtype=torch.float32)
    step = CapturedStep(lambda B, x: B @ x, warmup=1, graphs=FakeGraphs())
    x = torch.randn(M.shape[1], 3)
    for _ in range(2):
        step(A, x)
    A.val = A.val * 2  # the values replaced: the graph read the old ones
    step(A, x)
    torch.testing.assert_close(step(A, x), torch.from_numpy(2 * (M @ x.double().numpy())).float())
    assert step.captures == 2
    M2 = adjacency(seed=5)
    B = ts.csr(M2, dtype=torch.float32)
    step(B, x)
    torch.testing.assert_close(step(B, x), torch.from_numpy(M2 @ x.double().numpy()).float())
    assert step.captures == 3
