#!/usr/bin/env python3
"""Stage 3, reinforcement learning with the hierarchical reward (GRPO).

Each step draws ``prompts`` training cells (pattern, op, n, dtype); the policy samples a
group of ``group`` kernels for each. With ``--explore M``, M of each group are off-grid kernels
instead (parameter values and combinations the families' grid does not list, around the
policy's likeliest grid points, drawn by the policy's own scores:
``torch_sparserl.specialize.policy.propose``'s ``explore``), so that a kernel the grid lacks
can earn an advantage; they enter the update as the policy's completions like the samples.
``--reward-against oracle`` (the default) measures a correct kernel against the grid oracle's
speedup on the cell (its label): 1 at the oracle's speed, more only when faster. Every
distinct kernel is built with NVRTC and run by the evaluator in its sandbox; the reward
(``torch_sparserl.evaluate.reward``) is -0.5 if it does not compile, 0 if it compiles but is
wrong, 1 + (t_cuSPARSE / t_kernel - 1) if correct (``--reward-against cusparse``), minus
0.3 for resource overuse. cuSPARSE is timed once per cell per run, in the same process.
Advantages are the rewards normalised within each group (GRPO: no value network); the
update is PPO's clipped ratio plus a KL penalty to the SFT policy (k3 estimator).
Rewards of kernels already evaluated on the same cell are reused within a run. A sample whose
evaluation failed for the GPU's state at the time (no memory free: ``TRANSIENT_KINDS``) has no
reward: it is left out of its group's normalisation, gets no advantage, and is evaluated again
when sampled again. After SFT the
policy is nearly deterministic on its training cells (a group of 8 samples is often one
kernel: zero variance, no signal); ``--temperature`` > 1 defines the policy being optimised
as softmax(logits / T), for sampling, ratios and KL alike, so that groups differ.

Resumable in chunks: run again with the same ``--out``::

    python training/rl.py --init training/runs/sft/policy --out training/runs/rl --steps 40 --max-time-s 540

``--compile-only`` is the CPU smoke mode: the reward stops at the compile tier (nvcc).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.common import (Patterns, load_trainer, parse_args, save_checkpoint, start_stage)  # noqa: E402


@dataclass
class RLArgs:
    """GRPO on the hierarchical reward computed by the evaluator."""

    init: str = "training/runs/sft/policy"
    out: str = "training/runs/rl"
    labels: list[str] = field(default_factory=list)
    steps: int = 40
    prompts: int = 8
    group: int = 8
    lr: float = 3e-5
    kl_coef: float = 0.05
    clip: float = 0.2
    epochs: int = 2
    temperature: float = 1.0      # the policy RL optimises samples at this temperature (exploration)
    explore: int = 0              # off-grid kernels per group, in place of as many samples
    reward_against: str = "oracle"  # a correct kernel's speed: over the cell's grid oracle, or "cusparse"
    max_time_s: float = 540.0
    compile_only: bool = False
    max_cells: int = 0            # 0: every training cell (smoke tests use a few)
    seed: int = 0
    device: str = "auto"


class Rewarder:
    """Evaluates kernels for cells, memoised per (cell, source) within a run."""

    def __init__(self, patterns: Patterns, compile_only: bool):
        self.patterns, self.compile_only = patterns, compile_only
        self.memo: dict[tuple, object] = {}
        self.cusparse: dict[str, float] = {}
        self.box = None
        self.evaluations = 0

    def record(self, cell, proposal):
        from torch_sparserl.evaluate.record import ErrorKind, EvalRecord
        from torch_sparserl.specialize.autotune import SCREEN_CONFIG

        key = (cell.cell, proposal.spec.key)
        if key in self.memo:
            return self.memo[key]
        if proposal.error is not None:
            rec = EvalRecord(key=proposal.spec.key, family=proposal.family).fail(ErrorKind.PLAN, proposal.error)
        elif self.compile_only:
            from torch_sparserl.evaluate.compile_tier import compile_only

            rec = compile_only(proposal.spec)
        else:
            from torch_sparserl.evaluate.sandbox import Sandbox

            if self.box is None:
                self.box = Sandbox()
            rowptr, col, shape, _ = self.patterns.get(cell.matrix)
            self.box.set_matrix(cell.matrix, rowptr.astype(np.int32), col.astype(np.int32), shape)
            first = cell.cell not in self.cusparse
            # the GPU is training's alone; the reward's spill penalty needs the count
            config = dataclasses.replace(SCREEN_CONFIG, baseline=first, burst_reps=0, count_spills=True)
            rec = self.box.evaluate(proposal.spec, cell.matrix, cell.n, cell.dtype, config)
            if first and rec.cusparse_us:
                self.cusparse[cell.cell] = rec.cusparse_us
            elif cell.cell in self.cusparse:
                rec.cusparse_us = self.cusparse[cell.cell]
            self.evaluations += 1
        if not is_transient(rec):  # the device's state, not a verdict: evaluated again next time
            self.memo[key] = rec
        return rec

    def close(self):
        if self.box is not None:
            self.box.close()


def is_transient(record) -> bool:
    from torch_sparserl.evaluate.record import TRANSIENT_KINDS

    return record.error_kind in TRANSIENT_KINDS


def group_advantages(rewards: np.ndarray, valid: np.ndarray, group: int) -> np.ndarray:
    """GRPO's advantages: each group's rewards normalised by the group's mean and spread, over
    its ``valid`` samples only (the others, evaluations that failed for the device's state,
    get 0); a group whose valid rewards do not differ gives no signal (0)."""
    adv = np.zeros_like(rewards)
    for start in range(0, len(rewards), group):
        sl = slice(start, start + group)
        ok = valid[sl]
        r = rewards[sl][ok]
        if r.size > 1 and r.std() > 1e-6:
            adv[sl][ok] = (r - r.mean()) / (r.std() + 1e-6)
    return adv


def grpo_loss(policy, reference, inputs, requests, completions, old_lp, advantages, clip, kl_coef,
              temperature=1.0):
    new = policy.completion_logprobs(inputs, requests, completions, temperature)
    with torch.no_grad():
        ref = reference.completion_logprobs(inputs, requests, completions, temperature)
    losses, kls = [], []
    for lp, old, rf, adv in zip(new, old_lp, ref, advantages):
        ratio = torch.exp(lp - old)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        kl = torch.exp(rf - lp) - (rf - lp) - 1  # k3: unbiased, non-negative
        losses.append((-surrogate + kl_coef * kl).mean())
        kls.append(kl.mean().detach())
    return torch.stack(losses).mean(), float(torch.stack(kls).mean())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(RLArgs, argv)
    from torch_sparserl.evaluate.reward import reward
    from torch_sparserl.specialize.policy.model import KernelPolicy
    from torch_sparserl.specialize.policy.propose import to_proposal
    from training.data import load_labels
    from training.sft import Inputs, is_dev

    if not 0 <= args.explore < args.group:
        raise ValueError(f"rl: --explore must be from 0 to group - 1 = {args.group - 1} (got {args.explore})")
    if args.reward_against not in ("oracle", "cusparse"):
        raise ValueError(f"rl: --reward-against must be 'oracle' or 'cusparse' (got {args.reward_against!r})")
    stage = start_stage(args, "rl")
    device, out, ckpt, metrics, budget = stage.device, stage.out, stage.ckpt, stage.metrics, stage.budget
    resume = stage.resuming
    policy = KernelPolicy.load(ckpt if resume else Path(args.init), device)
    reference = KernelPolicy.load(Path(args.init), device)
    for p in reference.parameters():
        p.requires_grad_(False)
    cells = [lab for lab in load_labels(args.labels or None, split="train") if not is_dev(lab.matrix, 10)]
    patterns = Patterns()
    cells = patterns.keep_available(cells, "rl")
    rng = random.Random(args.seed)
    rng.shuffle(cells)
    if args.max_cells:
        cells = cells[:args.max_cells]
    inputs = Inputs(patterns, policy.config.samples, 8)
    rewarder = Rewarder(patterns, args.compile_only)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step = load_trainer(ckpt, opt)["step"] if resume else 0
    rng = random.Random(args.seed * 15485863 + step)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + step)
    print(f"rl: {len(cells)} training cells, {args.prompts} x {args.group} samples per step, "
          f"{'compile tier only' if args.compile_only else 'full reward'}, from step {step}", flush=True)
    try:
        while step < args.steps and not budget.spent():
            t0 = time.monotonic()
            chosen = rng.sample(cells, min(args.prompts, len(cells)))
            batch = []  # (cell, input, request ids, completion ids, reward, record)
            policy.eval()
            for cell in chosen:
                inp = inputs.get(_as_example(cell), rng.randrange(8))
                samples = policy.sample_speculative(inp, cell.op, cell.dtype, cell.n, k=args.group,
                                                    temperature=args.temperature, greedy_first=False, generator=gen)
                proposals = [to_proposal(s, cell.op, cell.dtype, cell.n) for s in samples]
                if args.explore:  # the group keeps its size: off-grid kernels replace the last samples
                    members = off_grid_members(policy, inp, patterns, cell, args.explore, args.temperature,
                                               rng.randrange(1 << 30))
                    proposals = proposals[:args.group - len(members)] + members
                for prop in proposals:
                    batch.append((cell, inp, policy.request_ids(cell.op, cell.dtype, cell.n), prop.sample.tokens, prop))
            t_gen = time.monotonic() - t0
            records = [rewarder.record(cell, prop) for cell, *_, prop in batch]
            rewards = np.array([reward(r, baseline=b[0].speedup if args.reward_against == "oracle" else None)
                                for r, b in zip(records, batch)], dtype=np.float64)
            valid = np.array([not is_transient(r) for r in records])
            t_eval = time.monotonic() - t0 - t_gen
            adv = group_advantages(rewards, valid, args.group)
            ins = [b[1] for b in batch]
            reqs = [b[2] for b in batch]
            comps = [b[3] for b in batch]
            with torch.no_grad():
                old = [lp.detach() for lp in policy.completion_logprobs(ins, reqs, comps, args.temperature)]
            policy.train()
            advantages = torch.tensor(adv, dtype=torch.float32, device=device)
            for _ in range(args.epochs):
                loss, kl = grpo_loss(policy, reference, ins, reqs, comps, old, advantages, args.clip, args.kl_coef,
                                     args.temperature)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
            step += 1
            correct = [r for r in records if r.correct]
            scored = rewards[valid] if valid.any() else np.zeros(1)
            metrics.log(step, reward_mean=float(scored.mean()), reward_max=float(scored.max()),
                        transient=int((~valid).sum()),
                        compile_rate=float(np.mean([bool(r.compiled) for r in records])),
                        correct_rate=float(np.mean([bool(r.correct) for r in records])),
                        speedup_mean=float(np.mean([r.speedup for r in correct if r.speedup])) if correct else 0.0,
                        distinct=len({(b[0].cell, b[4].spec.key) for b in batch}) / len(batch),
                        off_grid=sum(b[4].off_grid for b in batch),
                        off_grid_correct=sum(bool(b[4].off_grid and r.correct) for b, r in zip(batch, records)),
                        beats_oracle=sum(bool(r.correct and r.speedup and r.speedup > b[0].speedup)
                                         for b, r in zip(batch, records)),
                        loss=loss.item(), kl=kl, gen_s=round(t_gen, 2), eval_s=round(t_eval, 2),
                        evaluations=rewarder.evaluations)
            save_checkpoint(ckpt, policy, opt, step, {"stage": "rl", "args": dataclasses.asdict(args)})
    finally:
        rewarder.close()
    return stage.finish("rl", policy, opt, step, args.steps, {"stage": "rl", "args": dataclasses.asdict(args)})


def off_grid_members(policy, inp, patterns, cell, count: int, temperature: float, seed: int) -> list:
    """``count`` off-grid proposals for ``cell``, as ``propose(strategy="explore")`` draws them
    (its first member, the grid's likeliest, left out), each checked against its family's domain."""
    from torch_sparserl.specialize.policy.propose import explore_proposals

    features = patterns.get(cell.matrix)[3]
    return explore_proposals(policy, inp, features, cell.op, cell.dtype, cell.n, count + 1, temperature, seed)[1:]


def _as_example(label):
    from training.sft import Example

    return Example(label.matrix, label.op, label.dtype, label.n, [], label.family)


if __name__ == "__main__":
    sys.exit(main())
