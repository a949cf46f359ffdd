"""The library's background threads and CUDA's stream capture mode (CPU side)."""

from __future__ import annotations

import ctypes

import torch

from torch_sparserl.config import JitOptions
from torch_sparserl.jit.runtime import Runtime
from torch_sparserl.pattern import streams


def test_without_cuda_the_mode_is_left_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    asked = []
    monkeypatch.setattr(streams, "_cudart_function", lambda name: asked.append(name))
    assert streams.relax_capture_mode() is False and asked == []


def test_the_thread_asks_cuda_for_the_relaxed_mode(monkeypatch):
    """The exchange is called with cudaStreamCaptureModeRelaxed (2), in the calling thread."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []

    def exchange(pointer):
        seen.append(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int)).contents.value)
        return 0

    monkeypatch.setattr(streams, "_cudart_function", lambda name: exchange if name ==
                        "cudaThreadExchangeStreamCaptureMode" else None)
    assert streams.relax_capture_mode() is True and seen == [2]
    monkeypatch.setattr(streams, "_cudart_function", lambda name: (lambda pointer: 900))
    assert streams.relax_capture_mode() is False  # an error code: said, not raised


def test_a_missing_cuda_runtime_is_not_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(streams, "_cudart_function", lambda name: None)
    assert streams.relax_capture_mode() is False


def test_the_runtimes_threads_start_relaxed(monkeypatch):
    relaxed = []
    monkeypatch.setattr("torch_sparserl.jit.workers.relax_capture_mode", lambda: relaxed.append(1))
    runtime = Runtime(JitOptions(mode="background"), devices=("cpu",))
    try:
        assert runtime._pool().submit(lambda: 7).result() == 7
        assert runtime._library_pool().submit(lambda: 8).result() == 8
        assert relaxed == [1, 1]  # once per thread, before its first task
    finally:
        runtime.close()
