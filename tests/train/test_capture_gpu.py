"""``ts.capture_step`` on a GPU: a two-layer GCN on a shipped matrix, its whole training step
(forward, loss, backward, a capturable Adam's step) replayed as one CUDA graph, against the same
training run eagerly; the graph captured again when a decision lands, a capture that the
runtime's background work does not invalidate, a closed runtime that is never replayed, padded
mini-batches with a graph per bucket, and a compiled model captured.

Run on the device: ``pytest -m gpu tests/train/test_capture_gpu.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.config import JitOptions
from torch_sparserl.dtypes import assert_close_to_reference, tolerance
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import KernelCache

from fakes import fixed_specializer, using_runtime as using
from helpers import padded_batch_step

STEPS = 20
FEATURES, HIDDEN, CLASSES = 32, 64, 8


def normalized(M: sp.csr_matrix) -> sp.csr_matrix:
    """``D^-1/2 (A + I) D^-1/2`` of the binary pattern of ``M``, float64."""
    A = (abs(M) > 0).astype(np.float64)
    A = ((A + A.T) > 0).astype(np.float64) + sp.identity(M.shape[0], format="csr")
    scale = sp.diags(1.0 / np.sqrt(np.asarray(A.sum(axis=1)).ravel()))
    return (scale @ A @ scale).tocsr()


class Gcn:
    """A two-layer GCN on ``product`` (the adjacency product), trained with a capturable Adam on
    fresh random data (seeded: every instance starts the same); ``step(x, y)`` is one step."""

    def __init__(self, n: int, product, device="cuda", dtype=torch.float32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64).to(device, dtype)
        self.y = torch.randint(0, CLASSES, (n,), generator=g).to(device)
        self.mask = torch.arange(0, n, 2, device=device)
        self.w1 = torch.nn.Parameter((0.2 * torch.randn(FEATURES, HIDDEN, generator=g, dtype=torch.float64)).to(device, dtype))
        self.w2 = torch.nn.Parameter((0.2 * torch.randn(HIDDEN, CLASSES, generator=g, dtype=torch.float64)).to(device, dtype))
        self.opt = torch.optim.Adam([self.w1, self.w2], lr=0.01, capturable=device == "cuda")
        self.product = product

    def loss(self, x, y):
        h = torch.relu(self.product(x @ self.w1))
        return torch.nn.functional.cross_entropy(self.product(h @ self.w2)[self.mask], y[self.mask])

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(x, y)
        loss.backward()
        self.opt.step()
        return loss.detach()


def on_gpu(M: sp.csr_matrix):
    """``(A, model)``: ``M`` as a float32 CSRMatrix on the GPU and a :class:`Gcn` on it."""
    A = ts.csr(M, dtype=torch.float32, device="cuda")
    return A, Gcn(M.shape[0], lambda h: A @ h)


def eager_losses(M: sp.csr_matrix, steps: int, cache_root=None) -> torch.Tensor:
    """The same training, eagerly: on the active runtime, or on a sync one with the fixed
    specializer's kernels where ``cache_root`` is given."""
    if cache_root is not None:
        with using(JitOptions(mode="sync"), cache_root, specializer=fixed_specializer):
            return eager_losses(M, steps)
    _, model = on_gpu(M)
    return torch.stack([model.step(model.x, model.y) for _ in range(steps)]).cpu()


def assert_same_training(got: torch.Tensor, want: torch.Tensor) -> None:
    """Losses of the captured and the eager training, step by step, within float32's relative
    tolerance (the same kernels; only the reduction order of a few may differ)."""
    rel = ((got.double() - want.double()).abs() / want.double().abs()).max().item()
    assert rel <= tolerance(torch.float32).rel_norm, (rel, got, want)


@pytest.fixture(scope="module")
def cora():
    return normalized(ts.load_matrix("cora"))


def test_a_captured_gcn_trains_as_the_eager_one(tmp_path, cora):
    with using(JitOptions(mode="sync", strict=True), tmp_path, specializer=fixed_specializer) as runtime:
        want = eager_losses(cora, STEPS)
        A, model = on_gpu(cora)
        step = ts.capture_step(model.step)
        got = torch.stack([step(model.x, model.y).clone() for _ in range(STEPS)]).cpu()
        assert step.captured and step.captures == 1 and not step.eager
        entry = patterns.lookup(A.crow, A.col, cora.shape[1])
        assert isinstance(runtime.state("spmm", entry, HIDDEN, torch.float32), rt.Installed)
    assert_same_training(got, want)
    # the first step's loss against the float64 reference (before Adam's steps drift apart)
    dense = torch.from_numpy(cora.toarray())
    reference = Gcn(cora.shape[0], lambda h: dense @ h, device="cpu", dtype=torch.float64)
    assert_close_to_reference(got[:1], reference.loss(reference.x, reference.y).detach().reshape(1), torch.float32)


def test_a_decision_landing_after_the_capture_captures_the_kernels(tmp_path, cora):
    gate = threading.Event()

    def gated(key, crow, col, ncols):
        assert gate.wait(120)
        return fixed_specializer(key, crow, col, ncols)

    want = eager_losses(cora, STEPS, tmp_path / "eager")
    with using(JitOptions(mode="background", admit_age_s=0), tmp_path / "background", specializer=gated) as runtime:
        A, model = on_gpu(cora)
        step = ts.capture_step(model.step)
        losses = [step(model.x, model.y).clone() for _ in range(5)]
        assert step.captures == 1  # with cuSPARSE: the decisions are pending
        gate.set()
        runtime.wait(300)
        losses += [step(model.x, model.y).clone() for _ in range(STEPS - 5)]
        assert step.captures == 2
        entry = patterns.lookup(A.crow, A.col, cora.shape[1])
        assert isinstance(runtime.state("spmm", entry, HIDDEN, torch.float32), rt.Installed)
    assert_same_training(torch.stack(losses).cpu(), want)


def test_the_runtimes_background_work_does_not_invalidate_a_capture(tmp_path, cora):
    """While the step is captured, the background thread copies to the host and synchronizes
    its stream (as a decision does): the capture (thread-local) holds, and replays train."""
    capturing, worked = threading.Event(), threading.Event()

    def busy(key, crow, col, ncols):
        if capturing.wait(120):
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.ones(1024, device="cuda").sum().cpu()
            side.synchronize()
            worked.set()
        return fixed_specializer(key, crow, col, ncols)

    want = eager_losses(cora, STEPS, tmp_path / "eager")
    with using(JitOptions(mode="background", admit_age_s=0), tmp_path / "background", specializer=busy) as runtime:
        _, model = on_gpu(cora)

        def train_step(x, y):
            if torch.cuda.is_current_stream_capturing():
                capturing.set()
                assert worked.wait(60)  # the background thread's device work, during the capture
            return model.step(x, y)

        step = ts.capture_step(train_step)
        losses = [step(model.x, model.y).clone() for _ in range(STEPS)]
        assert worked.is_set() and step.captures >= 1
        runtime.wait(300)
    assert_same_training(torch.stack(losses).cpu(), want)


def test_a_closed_runtime_is_never_replayed(tmp_path, cora):
    want = eager_losses(cora, STEPS, tmp_path / "eager")
    first = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path / "first"), specializer=fixed_specializer)
    previous = rt.set_active(first)
    try:
        _, model = on_gpu(cora)
        step = ts.capture_step(model.step)
        losses = [step(model.x, model.y).clone() for _ in range(6)]
        first.close()
        with pytest.raises(RuntimeError, match="capture_step: the JIT runtime the step was captured under was closed"):
            step(model.x, model.y)
        with using(JitOptions(mode="sync"), tmp_path / "second", specializer=fixed_specializer):
            losses += [step(model.x, model.y).clone() for _ in range(STEPS - 6)]
            assert step.captures == 2
    finally:
        rt.set_active(previous)
    assert_same_training(torch.stack(losses).cpu(), want)


def test_padded_mini_batches_replay_a_graph_per_bucket(tmp_path, cora):
    """Mini-batches of cora padded to two buckets, each batch's ``(crow, col, val)`` passed to the
    step and built into a matrix inside it: one graph per bucket, the indices checked inside the
    graph at every replay, the losses the eager loop's; bad indices in a replay give a NaN loss."""
    from torch_sparserl.data.buckets import Buckets
    from torch_sparserl.data.sampling import neighbor_batches

    batches = list(neighbor_batches(cora, 128, [5, 3], seed=1, limit=8))
    buckets = Buckets.fit(batches, count=2)
    padded = [buckets.pad(batch) for batch in batches]
    g = torch.Generator().manual_seed(2)
    features = torch.randn(cora.shape[0], FEATURES, generator=g).cuda()
    labels = torch.randint(0, CLASSES, (cora.shape[0],), generator=g).cuda()

    def train(capture: bool):
        weight = torch.nn.Parameter((0.2 * torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(3)))
                                    .cuda())
        opt = torch.optim.Adam([weight], lr=0.01, capturable=True)

        step = padded_batch_step(weight, opt)

        stepper = ts.capture_step(step, max_shapes=4) if capture else step
        losses = []
        for _ in range(3):
            for batch in padded:
                crow, col, val = (t.cuda() for t in batch.parts())
                nodes = torch.from_numpy(batch.nodes).long().cuda()
                seeds = (torch.arange(batch.shape[0], device="cuda") < batch.seeds).float()
                losses.append(stepper(features[nodes], labels[nodes[: batch.shape[0]]], crow, col, val, seeds).clone())
        return torch.stack(losses).cpu(), stepper, (features[nodes], labels[nodes[: batch.shape[0]]], crow, col, val,
                                                    seeds)

    with using(JitOptions(mode="background"), tmp_path):
        want, _, _ = train(False)
        got, stepper, last = train(True)
        assert stepper.captured == len({(b.shape, b.nnz) for b in padded}) and not stepper.eager
        x, y, crow, col, val, seeds = last
        bad = col.clone()
        bad[0] = x.shape[0] + 10**6
        assert stepper(x, y, crow, bad, val, seeds).isnan().item()
    assert_same_training(got, want)


def test_a_compiled_model_captured_trains_as_the_eager_one(tmp_path, cora):
    """torch.compile(backend="sparserl") and ts.capture_step together: the compiled forward and
    backward warm up (compiling), then the whole step is one graph; the losses are eager's."""
    torch._dynamo.reset()
    with using(JitOptions(mode="sync", strict=True), tmp_path, specializer=fixed_specializer):
        want = eager_losses(cora, STEPS)
        _, model = on_gpu(cora)
        model.loss = torch.compile(model.loss, backend="sparserl")
        step = ts.capture_step(model.step)
        got = torch.stack([step(model.x, model.y).clone() for _ in range(STEPS)]).cpu()
        assert step.captured and step.captures == 1 and not step.eager
    torch._dynamo.reset()
    assert_same_training(got, want)
