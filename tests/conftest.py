import os
import sys
from pathlib import Path

# Tests are in a folder per pipeline stage (tests/<stage>/): their shared modules (helpers,
# adversarial) live here, found from any of them.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The operator tests exercise torch's sparse kernels (cuSPARSE, MKL) on many random patterns; the
# JIT runtime is tested on its own (test_runtime*.py), which configures it explicitly.
os.environ.setdefault("SPARSERL_JIT", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

from torch_sparserl.tensor import intercept  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marker it adds must count there
def pytest_collection_modifyitems(config, items):
    """Every test of a ``*_gpu.py`` file is a GPU test (the suite's convention: a stage's GPU-only
    tests sit beside its CPU tests, in files named so); other tests are marked one by one (the
    ``cuda`` case of :func:`device`). Without CUDA they are skipped, saying how to run them."""
    gpu = pytest.mark.gpu
    for item in items:
        if item.path.name.endswith("_gpu.py"):
            item.add_marker(gpu)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python tests/gpu_suite.py` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def poison_uninitialized():
    """torch.empty returns NaN-filled memory, so any element a kernel leaves unwritten shows."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture
def fresh_intercept():
    """Each test sees the interception as a new process would."""
    intercept.reset_warnings()
    yield
    intercept.deactivate_backend()
    intercept.reset_warnings()
    assert not intercept.installed()


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from nothing: no code, guards or counters of an earlier test (use it
    through ``pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
