"""From the policy to a validated kernel: the learned counterpart of ``autotune.tune``.

:func:`propose` turns the policy's completions for one pattern into candidates: the request
plus what the policy wrote is a compact ABI source; its ``#include "sparserl/..."`` lines are
expanded (:func:`torch_sparserl.specialize.families.expand_headers`) into the self-contained
translation unit every builder takes. A completion that cannot become a source (unfinished,
an unknown header) is still a candidate: the evaluator scores it as a compile-tier failure.
Two strategies give the completions:

* ``"rank"`` (the runtime's): the policy scores every kernel of the families' space for the
  pattern (the autotuner's candidates, the text the policy was trained to write) and the K
  most likely distinct ones are the candidates. One batched forward pass instead of K
  decodes, and K distinct kernels where sampling a confident policy gives one kernel K times.
* ``"sample"``: K decoded completions, the first greedy (the stochastic policy that RL
  trains; it may write a kernel outside the space).
* ``"explore"`` (opt-in, for exploring beyond the grid): the policy's first choice of the space
  (as ``"rank"``), then K - 1 *off-grid* kernels: in-domain neighbours of its
  :data:`EXPLORE_ANCHORS` likeliest grid points (:func:`torch_sparserl.specialize.offgrid.off_grid`:
  other parameter values and combinations the templates accept and the grid never lists),
  rendered through their family's template, scored by the policy like the space, and drawn
  without replacement with probabilities softmax(log-probability / temperature) (``seed``;
  temperature 0: the likeliest). Each proposal's text passes
  :func:`~torch_sparserl.specialize.offgrid.check_declared` (a refusal is a plan failure, never
  built) and carries ``off_grid``.

:func:`policy_tune` evaluates the distinct candidates in the sandbox with the screening
configuration, then validates the fastest correct ones with the full configuration (fresh
trials, determinism, cuSPARSE timed in the same run): the autotuner's search
(:mod:`~torch_sparserl.specialize.search`) on the policy's candidates.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass

import torch

from ... import config
from ...abi import KernelSpec, PlanError
from ...evaluate.config import EvalConfig
from ...evaluate.record import ErrorKind, EvalRecord, TransientFailure, dtype_name
from .. import search
from ..autotune import FINAL_CONFIG, SCREEN_CONFIG, TuneResult
from .corpus import request
from .encoder import PatternInput
from .model import KernelPolicy, Sample

STRATEGIES = ("rank", "sample", "explore")
EXPLORE_ANCHORS = 2  # grid points whose neighbours "explore" draws from, the likeliest first
_FAMILY_LINE = re.compile(r"^// family: ([a-z_]+)\((.*)\)\s*$", re.M)


@dataclass
class Proposal:
    """One sampled candidate: what the policy wrote and the spec built from it (or why not)."""

    sample: Sample
    compact: str            # request + completion: the text the policy wrote, headers by name
    spec: KernelSpec        # the expanded source (the compact text when expansion failed)
    error: str | None = None
    off_grid: bool = False  # strategy="explore": a kernel outside the grid (offgrid.off_grid)

    @property
    def family(self) -> str:
        return self.spec.family


def _family(text: str) -> tuple[str, tuple]:
    m = _FAMILY_LINE.search(text)
    if not m:
        return "", ()
    params = tuple((k, v) for k, _, v in (p.partition("=") for p in re.split(r",(?![^()]*\))", m.group(2))) if k)
    return m.group(1), params


def to_proposal(sample: Sample, op: str, dtype: str, n: int, *, check_domain: bool = False) -> Proposal:
    """The candidate a completion makes; with ``check_domain``, a text that is not its declared
    family's template inside the family's domain (:func:`~torch_sparserl.specialize.offgrid.check_declared`)
    carries the refusal as its error, so it is never built."""
    from ..families import expand_headers
    from ..offgrid import check_declared

    compact = request(op, dtype, n) + sample.text
    family, params = _family(compact)
    error = None if sample.finished else "the completion did not end (no <eos> within the token limit)"
    try:
        source = expand_headers(compact)
        if check_domain and error is None:
            check_declared(compact, op=op, dtype=dtype, n=n)
    except PlanError as exc:
        source, error = compact, str(exc)
    return Proposal(sample, compact, KernelSpec(source, family, params), error)


def propose(policy: KernelPolicy | SandboxedPolicy, rowptr, col, shape, *, op: str, n: int, dtype: str = "f32",
            k: int = 4, seed: int = 0, temperature: float = 1.0, features: dict | None = None,
            strategy: str = "rank") -> list[Proposal]:
    """At most K candidates for one pattern, the policy's first choice first (``strategy``:
    see the module docstring; ``seed`` and ``temperature`` apply to ``"sample"``, and ``seed``
    also picks the nonzeros the encoder reads)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"propose: strategy must be one of {STRATEGIES} (got {strategy!r})")
    if k < 1:
        raise ValueError(f"propose: k must be >= 1 (got {k})")
    if strategy == "explore" and k < 2:
        raise ValueError(f"propose: strategy='explore' needs k >= 2 (the first choice of the grid and k - 1 "
                         f"off-grid kernels), got k={k}")
    if strategy == "explore" and not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"propose: strategy='explore' needs a finite temperature >= 0 (got {temperature})")
    dtype = dtype_name(dtype)
    if features is None:
        from ...pattern.features import structural_features

        features = structural_features(rowptr, col, shape)
    inp = PatternInput.from_pattern(rowptr, col, shape, op, dtype, n, policy.config.samples, seed=seed,
                                    features=features)
    if strategy == "explore":
        if isinstance(policy, SandboxedPolicy):
            return _explored(policy.explore(inp, features, op, dtype, n, k=k, temperature=temperature, seed=seed),
                             op, dtype, n)
        return explore_proposals(policy, inp, features, op, dtype, n, k, temperature, seed)
    if isinstance(policy, SandboxedPolicy):
        samples = (policy.rank(inp, features, op, dtype, n, k=k) if strategy == "rank" else
                   policy.sample(inp, op, dtype, n, k=k, temperature=temperature, seed=seed))
    elif strategy == "rank":
        samples = _rank(policy, inp, features, op, dtype, n, k)
    else:
        samples = _sample(policy, inp, op, dtype, n, k, temperature, seed)
    return [to_proposal(s, op, dtype, n) for s in samples]


def _sample(policy: KernelPolicy, inp: PatternInput, op, dtype, n, k, temperature, seed) -> list[Sample]:
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    return policy.sample_speculative(inp, op, dtype, n, k=k, temperature=temperature, generator=gen)


def _scored(policy: KernelPolicy, inp: PatternInput, points: list[tuple[str, dict]], op, dtype, n
            ) -> list[tuple[Sample, tuple[str, dict]]]:
    """Each distinct kernel of ``points`` rendered as the policy writes it, with the policy's
    log-probability of writing it, likeliest first."""
    from .corpus import completion_text, render_compact

    texts: dict[str, tuple[str, dict]] = {}
    for f, p in points:
        texts.setdefault(completion_text(render_compact(f, p, op, dtype, n), op, dtype, n), (f, p))
    order = list(texts)
    ids = policy.completion_ids(order)
    scores = policy.score_ids(inp, op, dtype, n, ids)
    ranked = sorted(range(len(order)), key=lambda i: -scores[i])
    return [(Sample(text=order[i], tokens=ids[i], logprob=scores[i], finished=True), texts[order[i]]) for i in ranked]


def _rank(policy: KernelPolicy, inp: PatternInput, features: dict, op, dtype, n, k) -> list[Sample]:
    """The K kernels of the space the policy is likeliest to write, most likely first."""
    from .. import families as fam

    return [s for s, _ in _scored(policy, inp, fam.space(op, dtype, n, features), op, dtype, n)[:k]]


def _explore(policy: KernelPolicy, inp: PatternInput, features: dict, op, dtype, n, k, temperature, seed
             ) -> list[tuple[Sample, bool]]:
    """The policy's first choice of the grid, then up to K - 1 off-grid neighbours of its
    :data:`EXPLORE_ANCHORS` likeliest grid points, drawn by the policy's scores (module docstring).
    Returns ``(sample, off_grid)`` pairs."""
    from .. import families as fam
    from ..offgrid import off_grid

    grid = _scored(policy, inp, fam.space(op, dtype, n, features), op, dtype, n)
    anchors = [point for _, point in grid[:EXPLORE_ANCHORS]]
    beyond = _scored(policy, inp, off_grid(anchors, op=op, dtype=dtype, n=n, features=features), op, dtype, n)
    return [(grid[0][0], False)] + [(s, True) for s in draw([s for s, _ in beyond], k - 1, temperature, seed)]


def explore_proposals(policy: KernelPolicy, inp: PatternInput, features: dict, op, dtype, n, k, temperature, seed
                      ) -> list[Proposal]:
    """``propose(strategy="explore")`` on an encoded pattern (RL's groups use it): the grid's
    first choice, then up to K - 1 off-grid kernels, each checked against its family's domain."""
    return _explored(_explore(policy, inp, features, op, dtype, n, k, temperature, seed), op, dtype, n)


def _explored(found: list[tuple[Sample, bool]], op, dtype, n) -> list[Proposal]:
    out = []
    for s, beyond in found:
        out.append(to_proposal(s, op, dtype, n, check_domain=True))
        out[-1].off_grid = beyond
    return out


def draw(samples: list[Sample], count: int, temperature: float, seed: int) -> list[Sample]:
    """``count`` of ``samples`` drawn without replacement with probabilities
    softmax(logprob / temperature) (Gumbel top-k, ``seed``); temperature 0: the likeliest, in order."""
    if temperature == 0 or len(samples) <= count:
        order = sorted(range(len(samples)), key=lambda i: -samples[i].logprob)
    else:
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(len(samples), generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        keys = torch.tensor([s.logprob for s in samples], dtype=torch.float64) / temperature - torch.log(-torch.log(u))
        order = torch.argsort(keys, descending=True).tolist()
    return [samples[i] for i in order[:count]]


class SandboxedPolicy:
    """The policy run in a sandbox's worker process instead of the caller's.

    The runtime specializes in a background thread of the user's process, next to a training
    loop. Loading the policy (the weights, the draft index) and decoding (a Python loop of
    small GPU steps) there would take the interpreter lock from the loop; in the sandbox's
    worker, which already holds a CUDA context on the same GPU, the thread only waits on a
    pipe. Samples are those of
    :meth:`KernelPolicy.sample_speculative` on the worker's device with the same seed.
    """

    def __init__(self, sandbox, checkpoint, timeout_s: float = 300.0):
        from .model import read_config

        self.sandbox, self.checkpoint, self.timeout_s = sandbox, str(checkpoint), timeout_s
        self.config, _ = read_config(checkpoint)

    def _run(self, task, *args):
        outcome = self.sandbox.run(task, (self.checkpoint, *args), timeout_s=self.timeout_s)
        if not outcome.ok:
            failure = TransientFailure if outcome.error.startswith("OutOfMemoryError") else RuntimeError
            raise failure(f"policy: {task.__name__} in the sandbox's worker failed ({outcome.status}): "
                          f"{outcome.error}\n{outcome.traceback or outcome.output_tail}")
        return outcome.value

    def load(self) -> dict:
        """Load the policy in the worker now (the first sample would); returns its device."""
        return self._run(load_task)

    def sample(self, inp: PatternInput, op: str, dtype: str, n: int, *, k: int, temperature: float,
               seed: int) -> list[Sample]:
        found = self._run(sample_task, inp.rows, inp.cols, tuple(inp.shape), inp.features, op, dtype, int(n),
                          int(k), float(temperature), int(seed))
        return [Sample(**fields) for fields in found]

    def rank(self, inp: PatternInput, features: dict, op: str, dtype: str, n: int, *, k: int) -> list[Sample]:
        found = self._run(rank_task, inp.rows, inp.cols, tuple(inp.shape), inp.features, dict(features), op,
                          dtype, int(n), int(k))
        return [Sample(**fields) for fields in found]

    def explore(self, inp: PatternInput, features: dict, op: str, dtype: str, n: int, *, k: int,
                temperature: float, seed: int) -> list[tuple[Sample, bool]]:
        found = self._run(explore_task, inp.rows, inp.cols, tuple(inp.shape), inp.features, dict(features), op,
                          dtype, int(n), int(k), float(temperature), int(seed))
        return [(Sample(**fields), bool(beyond)) for fields, beyond in found]


POLICY_DEVICES = config.POLICY_DEVICES


def worker_policy_device() -> str:
    """Where the sandbox's worker samples the policy: the GPU when there is one, unless
    ``SPARSERL_POLICY_DEVICE=cpu`` (an experiment switch: the policy's small kernels then stay
    off the GPU that a training loop uses while its kernels are decided). The GPU is the
    default: on the CPU the kernels are decided later, and the loop's epochs meanwhile were
    not measurably faster.
    A named error for anything else."""
    if config.read("specializer.policy_device") == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def _worker_policy(checkpoint: str) -> KernelPolicy:
    from .default import load_default

    device = worker_policy_device()
    if device == "cpu" and torch.cuda.is_available():
        # The worker shares the host with a training process: a few threads, not every core.
        torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // 4)))
    return load_default(device, checkpoint)


def load_task(checkpoint: str) -> dict:
    """Sandbox task: load the policy in the worker (once per worker process)."""
    return {"device": str(_worker_policy(checkpoint).device)}


def sample_task(checkpoint: str, rows, cols, shape, features, op: str, dtype: str, n: int, k: int,
                temperature: float, seed: int) -> list[dict]:
    """Sandbox task: K samples for one encoded pattern, as builtins (the pipe carries no torch objects)."""
    policy = _worker_policy(checkpoint)
    samples = _sample(policy, PatternInput(rows, cols, tuple(shape), features), op, dtype, n, k, temperature, seed)
    return [_plain(s) for s in samples]


def rank_task(checkpoint: str, rows, cols, shape, encoded, features: dict, op: str, dtype: str, n: int,
              k: int) -> list[dict]:
    """Sandbox task: the K likeliest kernels of the space for one encoded pattern, as builtins."""
    policy = _worker_policy(checkpoint)
    return [_plain(s) for s in _rank(policy, PatternInput(rows, cols, tuple(shape), encoded), features, op, dtype,
                                     n, k)]


def explore_task(checkpoint: str, rows, cols, shape, encoded, features: dict, op: str, dtype: str, n: int, k: int,
                 temperature: float, seed: int) -> list[tuple[dict, bool]]:
    """Sandbox task: the grid's first choice and K - 1 off-grid kernels, as builtins."""
    policy = _worker_policy(checkpoint)
    return [(_plain(s), beyond) for s, beyond in _explore(policy, PatternInput(rows, cols, tuple(shape), encoded),
                                                          features, op, dtype, n, k, temperature, seed)]


def _plain(s: Sample) -> dict:
    """A sample as builtins (the pipe carries no torch objects)."""
    return {"text": s.text, "tokens": [int(t) for t in s.tokens], "logprob": float(s.logprob),
            "finished": bool(s.finished), "token_logprobs": [float(v) for v in s.token_logprobs]}


def _failed(p: Proposal, op: str, n: int, dtype: str) -> EvalRecord:
    record = EvalRecord(key=p.spec.key, family=p.spec.family, params=dict(p.spec.params), op=op, n=n, dtype=dtype)
    return record.fail(ErrorKind.PLAN, p.error or "")


def policy_tune(matrix, *, op: str, n: int = 1, dtype="f32", policy: KernelPolicy | SandboxedPolicy, k: int = 4,
                sandbox=None, seed: int = 0, temperature: float = 1.0, finalists: int = 1,
                screen_config: EvalConfig = SCREEN_CONFIG, final_config: EvalConfig = FINAL_CONFIG,
                timeout_s: float = 60.0, features: dict | None = None,
                matrix_key: str | None = None, strategy: str = "rank",
                ) -> tuple[TuneResult, list[Proposal], list[EvalRecord]]:
    """Propose ``k`` candidates (``strategy`` as :func:`propose`), screen the distinct ones,
    validate the best ``finalists`` (and the next ones while none has passed the full validation).

    Returns the result (``best`` as the autotuner's), the proposals in the policy's order, and
    one record per proposal (duplicates share their record). The distinct candidates are
    compiled together before they are screened. When the proposals hold a single distinct
    runnable kernel it is validated directly, without a screening run.
    ``features`` and ``matrix_key`` may be passed when known, as to ``autotune.tune``.
    """
    from ...evaluate.sandbox import Sandbox

    dtype = dtype_name(dtype)
    start = time.monotonic()
    own = sandbox is None
    box = Sandbox() if own else sandbox
    records: dict[str, EvalRecord] = {}
    try:
        tuning = search.problem(matrix, box, n=n, dtype=dtype, timeout_s=timeout_s, features=features,
                                matrix_key=matrix_key)
        problem_s = time.monotonic() - start
        proposals = propose(policy, tuning.rowptr, tuning.col, tuning.shape, op=op, n=n, dtype=dtype, k=k, seed=seed,
                            temperature=temperature, features=tuning.features, strategy=strategy)
        gen_s = time.monotonic() - start - problem_s
        distinct: dict[str, Proposal] = {}  # the first proposal of each kernel, in the policy's order
        for p in proposals:
            distinct.setdefault(p.spec.key, p)
        runnable = {key: p.spec for key, p in distinct.items() if p.error is None}
        result = TuneResult(op=op, n=n, dtype=dtype, features=tuning.features, best=None, best_spec=None,
                            candidates=len(proposals))
        finals: dict[str, EvalRecord] = {}
        if len(runnable) > 1 or finalists < 1:
            # the distinct candidates compiled together, then screened
            screening = search.screen(tuning, list(runnable.values()), screen_config, start=start,
                                      chunk=len(runnable) if len(runnable) > 1 else 0)
            evaluated = {spec.key: record for record, spec in screening.screened}
            prebuild_s = screening.prebuild_s
        else:
            # One distinct runnable candidate (a confident policy): nothing to rank, so it goes
            # straight to the full validation, whose record stands for the screen too.
            evaluated = finals = {key: tuning.evaluate(spec, final_config, "final") for key, spec in runnable.items()}
            prebuild_s = 0.0
        for key, p in distinct.items():
            record = records[key] = _failed(p, op, n, dtype) if p.error is not None else evaluated[key]
            record.timing.setdefault("stage", "screen")
            result.table.append(record)
        result.screened = len(records)
        # fastest first; a finalist failing the full validation passes its turn on
        search.validate(tuning, [(records[key], p.spec) for key, p in distinct.items()], final_config, result,
                        finalists=finalists, until_one_passes=True, done=finals)
    finally:
        if own:
            box.close()
        else:
            box.release()  # the problem's inputs and references; the matrix stays for the next key
    result.elapsed_s = time.monotonic() - start
    for r in result.table:
        r.timing.setdefault("problem_s", round(problem_s, 4))
        r.timing.setdefault("generate_s", round(gen_s, 4))
        r.timing.setdefault("prebuild_s", round(prebuild_s, 4))
    return result, proposals, [records[p.spec.key] for p in proposals]
