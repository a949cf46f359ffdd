"""CUDA graphs recorded again once a graph's kernels are decided: the mechanics, with a fake
``cudagraphify`` (CPU). The real thing, under ``mode="reduce-overhead"``, is in
``test_cudagraphs_gpu.py``."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch._inductor.compile_fx as compile_fx

from torch_sparserl.compiler import cudagraphs
from torch_sparserl.jit import runtime as rt


@pytest.fixture
def made(monkeypatch):
    """A fake Inductor cudagraphify: each callable it makes returns (which one, model(x))."""
    calls = []

    def fake_cudagraphify(model, static_input_idxs=(), *, device_index, is_backward, is_inference, **kwargs):
        calls.append((model, is_backward))
        number = len(calls)
        return lambda inputs: (number, model(inputs))

    monkeypatch.setattr(compile_fx, "cudagraphify", fake_cudagraphify)
    return calls


def _graphs(decisions):
    with decisions.collecting():
        forward = compile_fx.cudagraphify(lambda x: x + 1, (), device_index=0, is_backward=False, is_inference=False)
        with decisions.collecting():  # the inner compile inside the backend's call: not wrapped twice
            backward = compile_fx.cudagraphify(lambda x: x * 2, (), device_index=0, is_backward=True,
                                               is_inference=False)
    return forward, backward


def test_graphs_are_recorded_again_at_the_forward_after_the_last_decision(made):
    first, second = Future(), Future()
    decisions = cudagraphs.Decisions([first, second])
    forward, backward = _graphs(decisions)
    assert getattr(compile_fx.cudagraphify, "_sparserl_decisions", None) is None  # restored
    assert [is_backward for _, is_backward in made] == [False, True]
    assert forward(1) == (1, 2) and backward(3) == (2, 6)
    first.set_result(rt.Installed(None, None))
    assert forward(1) == (1, 2) and decisions.waiting  # one decision still pending
    second.set_result(rt.Fallback(None, "cuSPARSE is faster", decided=True))
    assert backward(3) == (2, 6)  # a backward never swaps: it runs its forward's generation
    assert forward(1) == (3, 2) and backward(3) == (4, 6)  # both made again, from the same arguments
    assert [model(5) for model, _ in made] == [6, 10, 6, 10]
    assert decisions.rerecorded == 1 and not decisions.waiting
    assert forward(1) == (3, 2) and len(made) == 4  # once


@pytest.mark.parametrize("trees", [True, False])
def test_graphs_decided_before_they_recorded_are_not_made_again(made, trees):
    """Under CUDA graph trees a callable's first call warms up and its second records: decisions
    that land after the warm-up step leave the callables as they are (they record with the
    kernels). Without trees the first call records, so the graphs are made again."""
    import torch._inductor.config as config

    with config.patch({"triton.cudagraph_trees": trees}):  # the callables read it when they run
        future = Future()
        decisions = cudagraphs.Decisions([future])
        forward, backward = _graphs(decisions)
        assert forward(1) == (1, 2) and backward(3) == (2, 6)  # the compile's step
        future.set_result(rt.Installed(None, None))
        if trees:
            assert forward(1) == (1, 2) and backward(3) == (2, 6) and len(made) == 2
            assert decisions.rerecorded == 0 and decisions.decided_before_recording
        else:
            assert forward(1) == (3, 2) and backward(3) == (4, 6) and len(made) == 4
            assert decisions.rerecorded == 1 and not decisions.decided_before_recording
        assert not decisions.waiting


@pytest.mark.parametrize("outcome", ["fallback", "failed"])
def test_graphs_are_kept_when_no_kernel_was_installed(made, outcome):
    future = Future()
    decisions = cudagraphs.Decisions([future])
    forward, _ = _graphs(decisions)
    if outcome == "fallback":
        future.set_result(rt.Fallback(None, "specialization failed"))
    else:
        future.set_exception(RuntimeError("the background thread died"))
    assert forward(1) == (1, 2) and not decisions.waiting
    assert decisions.rerecorded == 0 and len(made) == 2


def test_only_the_collecting_graph_takes_the_callables(made):
    ours, other = cudagraphs.Decisions([Future()]), cudagraphs.Decisions([Future()])
    with ours.collecting():
        compile_fx.cudagraphify(lambda x: x, (), device_index=0, is_backward=False, is_inference=False)
    with other.collecting():
        compile_fx.cudagraphify(lambda x: x, (), device_index=0, is_backward=False, is_inference=False)
    compile_fx.cudagraphify(lambda x: x, (), device_index=0, is_backward=False, is_inference=False)
    assert len(ours.recordings) == 1 and len(other.recordings) == 1 and len(made) == 3



def test_this_torch_is_supported():
    assert cudagraphs.supported()
