#!/usr/bin/env python3
"""Stage 2, supervised fine-tuning on (pattern -> best kernel) pairs from the exhaustive autotuner.

Each training label (``training.data.load_labels``, train split only) gives one example: the
encoder's prefix for the matrix (coordinates resampled every epoch: a fresh sample of
nonzeros each time), the request (op, dtype, n), and the oracle's kernel as compact source.
Synthetic patterns whose index is a multiple of 10 are held out as a dev set for
monitoring (the validation matrices are not read at all). Resumable::

    python training/sft.py --init training/runs/pretrain/policy --out training/runs/sft --steps 1500
"""

from __future__ import annotations

import dataclasses
import random
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.common import (Patterns, cosine_lr, load_trainer, parse_args, save_checkpoint, start_stage)  # noqa: E402


@dataclass
class SFTArgs:
    """Fine-tune the pretrained LM and a fresh matrix encoder on the oracle's best kernels."""

    init: str = "training/runs/pretrain/policy"
    out: str = "training/runs/sft"
    labels: list[str] = field(default_factory=list)   # tables (default: training/labels, benchmarks/results)
    coords: str = "sinusoidal"                         # "raw": the ablation
    steps: int = 1500
    batch: int = 32
    lr: float = 5e-4
    encoder_lr: float = 2e-3
    weight_decay: float = 0.01
    resamples: int = 8             # coordinate samples drawn per matrix (augmentation)
    dev_every: int = 10            # every dev_every-th synthetic pattern is held out
    max_time_s: float = 540.0
    log_every: int = 50
    dev_every_steps: int = 250     # dev loss and greedy exact match (slow: it samples)
    save_every: int = 500
    seed: int = 0
    device: str = "auto"
    max_examples: int = 0          # 0: all (smoke tests use a few)


@dataclass
class Example:
    matrix: str
    op: str
    dtype: str
    n: int
    completion: list[int]
    family: str


def is_dev(matrix: str, every: int) -> bool:
    from training.data import TRAIN_MATRICES

    return every > 0 and matrix not in TRAIN_MATRICES and zlib.crc32(matrix.encode()) % every == 0


def make_examples(policy, labels, max_examples: int = 0) -> list[Example]:
    from torch_sparserl.specialize.policy.corpus import completion_text, render_compact
    from torch_sparserl.specialize.policy.tokenizer import EOS

    out, outside = [], 0
    for lab in labels:
        try:
            text = render_compact(lab.family, lab.params, lab.op, lab.dtype, lab.n)
        except ValueError:  # a label older than the space: e.g. a split family for a half-precision spmm
            outside += 1
            continue
        ids = policy.encode(completion_text(text, lab.op, lab.dtype, lab.n)) + [policy.ids[EOS]]
        out.append(Example(lab.matrix, lab.op, lab.dtype, lab.n, ids, lab.family))
    if outside:
        print(f"sft: {outside} of {len(labels)} labels name kernels outside the families' space now; skipped",
              flush=True)
    if max_examples:
        out = out[:max_examples]
    return out


class Inputs:
    """Encoder inputs per (matrix, request), with ``resamples`` coordinate draws per matrix."""

    def __init__(self, patterns: Patterns, samples: int, resamples: int):
        self.patterns, self.samples, self.resamples = patterns, samples, resamples
        self._coords: dict[tuple[str, int], tuple] = {}

    def get(self, ex: Example, draw: int):
        from torch_sparserl.specialize.policy.encoder import PatternInput, feature_vector, sample_coordinates

        rowptr, col, shape, feats = self.patterns.get(ex.matrix)
        key = (ex.matrix, draw % self.resamples)
        if key not in self._coords:
            self._coords[key] = sample_coordinates(rowptr, col, self.samples, seed=key[1])
        r, c = self._coords[key]
        return PatternInput(r, c, shape, feature_vector(feats, ex.op, ex.dtype, ex.n))


def evaluate_dev(policy, examples: list[Example], inputs: Inputs, limit: int = 48) -> dict:
    """Teacher-forced loss and greedy exact match of the whole kernel on held-out examples."""
    if not examples:
        return {}
    policy.eval()
    chosen = examples[:limit]
    with torch.no_grad():
        loss = policy.sft_loss([inputs.get(e, 0) for e in chosen],
                               [policy.request_ids(e.op, e.dtype, e.n) for e in chosen],
                               [e.completion for e in chosen]).item()
        exact = 0
        for e in chosen[:16]:
            s = policy.sample(inputs.get(e, 0), e.op, e.dtype, e.n, k=1, temperature=0.0,
                              max_new_tokens=len(e.completion) + 8)[0]
            exact += int(s.tokens == e.completion)
    policy.train()
    return {"dev_loss": loss, "dev_exact": exact / min(16, len(chosen))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(SFTArgs, argv)
    from torch_sparserl.specialize.policy.encoder import PatternEncoder
    from torch_sparserl.specialize.policy.model import KernelPolicy
    from training.data import load_labels

    stage = start_stage(args, "sft")
    device, out, ckpt, metrics, budget = stage.device, stage.out, stage.ckpt, stage.metrics, stage.budget
    resume = stage.resuming
    policy = KernelPolicy.load(ckpt if resume else Path(args.init), device)
    if not resume and policy.config.coords != args.coords:
        policy.config = dataclasses.replace(policy.config, coords=args.coords)
        policy.encoder = PatternEncoder(policy.config.hidden, policy.config.pe_dim, args.coords).to(device)
    labels = load_labels(args.labels or None, split="train")
    patterns = Patterns()
    labels = patterns.keep_available(labels, "sft")
    examples = make_examples(policy, labels, args.max_examples)
    train = [e for e in examples if not is_dev(e.matrix, args.dev_every)] or examples
    dev = [e for e in examples if is_dev(e.matrix, args.dev_every)]
    inputs = Inputs(patterns, policy.config.samples, args.resamples)
    opt = torch.optim.AdamW([
        {"params": policy.lm.parameters(), "lr": args.lr, "base": args.lr},
        {"params": policy.encoder.parameters(), "lr": args.encoder_lr, "base": args.encoder_lr},
    ], weight_decay=args.weight_decay, betas=(0.9, 0.95))
    step = load_trainer(ckpt, opt)["step"] if resume else 0
    print(f"sft: {len(train)} training examples ({len(labels)} labels), {len(dev)} dev, "
          f"coords={policy.config.coords}, device {device}, from step {step}", flush=True)
    rng = random.Random(args.seed * 104729 + step)
    policy.train()
    while step < args.steps and not budget.spent():
        chosen = [rng.choice(train) for _ in range(args.batch)]
        batch_inputs = [inputs.get(e, rng.randrange(args.resamples)) for e in chosen]
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, group["base"], warmup=30)
        loss = policy.sft_loss(batch_inputs, [policy.request_ids(e.op, e.dtype, e.n) for e in chosen],
                               [e.completion for e in chosen])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            dev_now = step % args.dev_every_steps == 0 or step == args.steps
            metrics.log(step, loss=loss.item(), **(evaluate_dev(policy, dev, inputs) if dev_now else {}))
        if step % args.save_every == 0:
            save_checkpoint(ckpt, policy, opt, step, {"stage": "sft", "args": dataclasses.asdict(args)})
    return stage.finish("sft", policy, opt, step, args.steps,
                        {"stage": "sft", "args": dataclasses.asdict(args),
                         "train_examples": len(train), "labels": len(labels)})


if __name__ == "__main__":
    sys.exit(main())
