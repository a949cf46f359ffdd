"""cuSPARSE inside a CUDA graph capture on a thread that never called it before: the handle
torch makes at a thread's first cuSPARSE call must exist before the capture
(:func:`torch_sparserl.kernels.vendor.ensure_handle`)."""

from __future__ import annotations

import threading

import torch

from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.kernels import vendor


def _in_a_new_thread(fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_product_by_cusparse_is_captured_on_a_thread_that_ensured_its_handle():
    g = torch.Generator().manual_seed(0)
    dense = (torch.rand(64, 48, generator=g) < 0.1) * torch.randn(64, 48, generator=g)
    X = torch.randn(48, 8, generator=g)
    A, static = dense.cuda().to_sparse_csr(), X.cuda()  # made on the main thread

    def capture_and_replay():
        vendor.ensure_handle(torch.device("cuda"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):  # no product ran on this thread before the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = torch.sparse.mm(A, static)
        torch.cuda.current_stream().wait_stream(side)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        return out.cpu()

    out = _in_a_new_thread(capture_and_replay)
    assert_close_to_reference(out, dense.double() @ X.double(), torch.float32)
