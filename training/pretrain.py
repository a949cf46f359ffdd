#!/usr/bin/env python3
"""Stage 1, pretraining: train the tokenizer, then the LM on kernel text.

The corpus: every compact source of the kernel families' parameter grids (the text the
policy will write) and the CUDA toolkit's CUB/Thrust headers (real CUDA C++, offline).
No matrix is read. Resumable: run again with the same ``--out`` to continue::

    python training/pretrain.py --out training/runs/pretrain --steps 3000 --max-time-s 540
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.common import (cosine_lr, load_trainer, parse_args, save_checkpoint, start_stage)  # noqa: E402


@dataclass
class PretrainArgs:
    """Pretrain the kernel LM on the families' sources and the toolkit's CUDA headers."""

    out: str = "training/runs/pretrain"
    vocab_size: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    intermediate: int = 704
    steps: int = 3000
    batch: int = 32
    seq_len: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    cuda_bytes: int = 4_000_000      # CUB/Thrust text (0: kernels only)
    cuda_fraction: float = 0.3       # share of rows drawn from the CUDA headers
    max_time_s: float = 540.0
    log_every: int = 50
    save_every: int = 500
    seed: int = 0
    device: str = "auto"


def build_corpus(args: PretrainArgs, tokenizer=None):
    """(tokenizer, kernel sequences, CUDA windows) as token-id lists with <bos>/<eos>."""
    from torch_sparserl.specialize.policy import corpus
    from torch_sparserl.specialize.policy.tokenizer import BOS, EOS, special_ids, train_tokenizer

    kernels = corpus.kernel_documents()
    cuda = corpus.cuda_documents(args.cuda_bytes, args.seed) if args.cuda_bytes else []
    if tokenizer is None:
        tokenizer = train_tokenizer(corpus.iter_texts(kernels, cuda), vocab_size=args.vocab_size)
    ids = special_ids(tokenizer)
    kseqs = [[ids[BOS]] + tokenizer.encode(doc[-1]).ids + [ids[EOS]] for doc in kernels]
    windows = []
    for text in cuda:
        toks = tokenizer.encode(text).ids
        for i in range(0, len(toks), args.seq_len):
            piece = toks[i:i + args.seq_len]
            if len(piece) >= 32:
                windows.append(piece)
    return tokenizer, kseqs, windows


def batch_tensors(seqs: list[list[int]], pad: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [s[:max_len] for s in seqs]
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    args = parse_args(PretrainArgs, argv)
    from torch_sparserl.specialize.policy.model import KernelPolicy, build
    from torch_sparserl.specialize.policy.tokenizer import PAD

    stage = start_stage(args, "pretrain")
    device, out, ckpt, metrics, budget = stage.device, stage.out, stage.ckpt, stage.metrics, stage.budget
    if ckpt.exists():
        policy = KernelPolicy.load(ckpt, device)
        tokenizer = policy.tokenizer
    else:
        tokenizer = None
    tokenizer, kseqs, windows = build_corpus(args, tokenizer)
    if not ckpt.exists():
        policy = build(tokenizer, hidden=args.hidden, layers=args.layers, heads=args.heads,
                       intermediate=args.intermediate, vocab_size=args.vocab_size,
                       max_positions=max(1024, args.seq_len + 512)).to(device)
    policy.train()
    opt = torch.optim.AdamW(policy.lm.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    step = 0
    if (ckpt / "trainer.pt").exists():
        step = load_trainer(ckpt, opt)["step"]
        print(f"pretrain: resuming at step {step}", flush=True)
    print(f"pretrain: {policy.num_parameters() / 1e6:.2f}M parameters, {len(kseqs)} kernels, "
          f"{len(windows)} CUDA windows, device {device}", flush=True)
    pad = policy.ids[PAD]
    rng = random.Random(args.seed * 7919 + step)
    while step < args.steps and not budget.spent():
        rows = [rng.choice(windows) if windows and rng.random() < args.cuda_fraction else rng.choice(kseqs)
                for _ in range(args.batch)]
        ids, mask = batch_tensors(rows, pad, args.seq_len)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr)
        loss = policy.lm_loss(ids.to(device), mask.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.lm.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            metrics.log(step, loss=loss.item(), lr=opt.param_groups[0]["lr"])
        if step % args.save_every == 0:
            save_checkpoint(ckpt, policy, opt, step, {"stage": "pretrain", "args": dataclasses.asdict(args)})
    return stage.finish("pretrain", policy, opt, step, args.steps,
                        {"stage": "pretrain", "args": dataclasses.asdict(args)})


if __name__ == "__main__":
    sys.exit(main())
