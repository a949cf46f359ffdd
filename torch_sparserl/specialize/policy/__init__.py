"""The learned kernel policy (SparseRL): a matrix encoder and a small causal LM that writes
ABI kernels, trained by pretraining, SFT on the autotuner's choices, and RL on the evaluator's
reward (``training/``). The trained checkpoint ships in ``checkpoint/`` beside this file.

    from torch_sparserl.specialize.policy import load_default, propose
    policy = load_default()
    candidates = propose(policy, rowptr, col, shape, op="spmm", n=32, k=4)
"""

from __future__ import annotations

from .default import CHECKPOINT_DIR, checkpoint_id, load_default


def propose(*args, **kwargs):
    from .propose import propose as _propose

    return _propose(*args, **kwargs)


__all__ = ["CHECKPOINT_DIR", "checkpoint_id", "load_default", "propose"]
