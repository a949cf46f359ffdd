"""Every setting of torch-sparserl in one tree: what it does, its default, what sets it.

:class:`Config` holds one group per part of the library. A group's fields are set in code
(the backend's options, :func:`torch_sparserl.jit.runtime.configure`) or by the environment
variable that names them, read here and nowhere else (:func:`from_environment`, :func:`read`)::

    Config
    ├── jit: JitOptions            the JIT runtime: runtime.configure(**fields), SPARSERL_JIT_*
    ├── backend: BackendOptions    one compiled model: torch.compile(options={...}) (no variables)
    ├── cache: CacheOptions        where kernels are kept
    ├── fast_path: FastPathOptions the C++ fast path of the whole process
    ├── specializer: SpecializerOptions  how the specializer's worker decides (experiment switches)
    └── log: LogOptions            logs and the CLI's tracebacks

Environment variables (an empty value is the same as none; a value that cannot be read or is
out of its range is an error naming the variable, what it expects and what it got; numbers are
finite: ``nan`` and ``inf`` are refused like any other word). The same ranges hold for the fields
set in code (``runtime.configure(idle_s=...)``, ``CacheOptions(max_mb=...)``), where the
ValueError names the field:

============================  ==========================  ===========================================
variable                      field                       values (default)
============================  ==========================  ===========================================
``SPARSERL_JIT``              ``jit.mode``                ``background``, ``sync``, ``off`` (background)
``SPARSERL_JIT_STRICT``       ``jit.strict``              a boolean: 1/0, true/false, yes/no, on/off (0)
``SPARSERL_JIT_MARGIN``       ``jit.margin``              a number from 1 to 100 (1.05)
``SPARSERL_JIT_BUDGET_S``     ``jit.budget_s``            seconds > 0, at most 3600 (20)
``SPARSERL_JIT_POLICY``       ``jit.policy``              ``learned``, ``autotune`` (learned)
``SPARSERL_JIT_K``            ``jit.k``                   a whole number from 1 to 64 (4)
``SPARSERL_JIT_IDLE_S``       ``jit.idle_s``              seconds from 0 to 86400; 0 keeps the worker (30)
``SPARSERL_JIT_ADMIT_CALLS``  ``jit.admit_calls``         a whole number from 1 to 1000000 (1)
``SPARSERL_JIT_ADMIT_AGE_S``  ``jit.admit_age_s``         seconds from 0 to 3600; 0: no wait (0.1)
``SPARSERL_JIT_QUEUE``        ``jit.queue``               a whole number from 1 to 4096 (4)
``SPARSERL_JIT_CLASS_AFTER``  ``jit.class_after``         a whole number from 0 to 1000000; 0: no class
                                                          kernels (0)
``SPARSERL_CACHE_DIR``        ``cache.dir``               a folder (``$XDG_CACHE_HOME/torch_sparserl``,
                                                          else ``~/.cache/torch_sparserl``)
``SPARSERL_CACHE_MAX_MB``     ``cache.max_mb``            megabytes from 0.1 to 1048576 (256)
``SPARSERL_CACHE_CUBINS``     ``cache.cubins``            a boolean (1)
``SPARSERL_FAST_PATH``        ``fast_path.enabled``       a boolean (1)
``SPARSERL_POLICY_DEVICE``    ``specializer.policy_device``  ``cuda``, ``cpu`` (cuda where there is one)
``SPARSERL_EVAL_BURST_REPS``  ``specializer.eval_burst_reps``  a whole number from 0 to 100000; 0: no
                                                          bursts (0)
``SPARSERL_LOG``              ``log.level``               ``debug``, ``info``, ``warning``, ``error``,
                                                          ``critical`` (logging's own setting)
``SPARSERL_DEBUG``            ``log.debug``               a boolean (0)
============================  ==========================  ===========================================

When they are read: ``SPARSERL_LOG`` and ``SPARSERL_EVAL_BURST_REPS`` once, when the package
(resp. the autotuner) is imported; every variable when the process's runtime is created (on
its first use, or by ``configure``, which starts from the current runtime's settings), which
keeps the ``SPARSERL_JIT*`` ones, and by every ``sparserl`` command before it starts; the
others again each time they are needed. A ``SPARSERL_LOG`` that cannot be read leaves logging
as it is at import, and is refused at the runtime's creation (an import does not raise for it). The sandbox's worker process inherits the
environment, so a variable set before the worker starts reaches it too.

A ``SPARSERL_*`` variable that is none of these (``SPARSERL_JTI=off``) is not silently ignored:
a :class:`ConfigWarning` names it, and the known ones, once per process. ``SPARSERL_SHARED``
(read by ``benchmarks/``) and ``SPARSERL_TEST_*`` (the test suite's) are not the library's but
are known.

``strict`` is one setting, ``jit.strict``: after a failure the runtime raises instead of
falling back to cuSPARSE, and so do the products of raw ``torch.sparse_csr`` tensors that the
backend routes (:mod:`torch_sparserl.tensor.intercept`). ``torch.compile(options={"strict": True})``
(``backend.strict``) turns it on for one compiled model's routed products; left unset, that
model follows ``jit.strict``.

Unknown names are refused: ``torch.compile(options=...)`` takes the fields of
:class:`BackendOptions` and Inductor's own config entries (passed on to Inductor, as the
``inductor`` backend takes them); ``runtime.configure(**changes)`` takes the fields of
:class:`JitOptions`. Either error lists the valid names.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------- defaults

DEFAULT_JIT_MODE = "background"
DEFAULT_STRICT = False
DEFAULT_JIT_MARGIN = 1.05
DEFAULT_JIT_BUDGET_S = 20.0
DEFAULT_JIT_POLICY = "learned"
DEFAULT_JIT_K = 4
DEFAULT_JIT_IDLE_S = 30.0
# 1: a product is decided on its first call. Mini-batch training, where each step has a new
# pattern, wants 3 (a fixed graph's products get there in the second step, a step's one-off
# pattern never does); the default stays 1 until benchmarks/bench_minibatch.py has measured both
# on a GPU.
DEFAULT_JIT_ADMIT_CALLS = 1
# Mini-batch training's sampled subgraph lives for one step (milliseconds): at 0.1 s no one-off
# pattern is decided, recorded or queued, while a fixed graph waits 0.1 s more for its kernels
# (which take seconds in the background). 0: decided as soon as it exists.
DEFAULT_JIT_ADMIT_AGE_S = 0.1
DEFAULT_JIT_QUEUE = 4  # decisions waiting for the background thread; more are dropped, not queued
# Young patterns of one class seen before the class gets a decision (jit/classes.py). Off by
# default: on the sampled mini-batches benchmarked, the steps were bound by the host, where a
# class's faster kernel saved nothing measurable, and the class's search slowed the first epoch
# (docs/experiments.md, "Class kernels"). 0: no class kernels.
DEFAULT_JIT_CLASS_AFTER = 0

DEFAULT_BACKEND_STRICT = None  # the runtime's jit.strict
DEFAULT_INTERCEPT_SPARSE = True
DEFAULT_PRESPECIALIZE = True
# Off: no gain was measured where the fused layer tail applied (benchmarks/bench_epilogue.py),
# and products served by split families cannot fuse. Opt in with options={"fuse_epilogues": True}.
DEFAULT_FUSE_EPILOGUES = False
DEFAULT_DIRECT_OPS = True
DEFAULT_FAST_PATH = True
DEFAULT_FLATTEN_MATRICES = True

DEFAULT_CACHE_DIR = None  # $XDG_CACHE_HOME/torch_sparserl, else ~/.cache/torch_sparserl
DEFAULT_CACHE_MAX_MB = 256.0  # the decisions on disk; least recently used ones go first
DEFAULT_CACHE_CUBINS = True
DEFAULT_FAST_PATH_ENABLED = True
DEFAULT_POLICY_DEVICE = "cuda"
DEFAULT_EVAL_BURST_REPS = 0
DEFAULT_LOG_LEVEL = None  # logging's own configuration
DEFAULT_DEBUG = False

MODES = ("background", "sync", "off")
POLICIES = ("learned", "autotune")
POLICY_DEVICES = ("cuda", "cpu")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_K = 64

# The ranges of the numeric settings. The upper bounds are far past any use (a value beyond is
# a typo or an attempt at "never", which each setting has a way to say) and keep every value
# something the code can compute with: a timer of 1e10 s overflows, a cap of 1e308 MB is no int.
MAX_JIT_MARGIN = 100.0  # a kernel 100x faster than cuSPARSE or none
MAX_JIT_BUDGET_S = 3600.0  # per key; a search takes seconds
MAX_JIT_IDLE_S = 86400.0  # a day; 0 keeps the worker for good
MAX_JIT_ADMIT_CALLS = 1_000_000  # calls before a decision; SPARSERL_JIT=off is "never"
MAX_JIT_ADMIT_AGE_S = 3600.0
MAX_JIT_QUEUE = 4096  # decisions waiting; each holds a pattern's indices
MAX_JIT_CLASS_AFTER = 1_000_000  # young patterns of a class; 0 is "never"
MIN_CACHE_MAX_MB = 0.1  # a few entries (tens of kB each); below, every write would empty the cache
MAX_CACHE_MAX_MB = float(1 << 20)  # 1 TiB
MAX_EVAL_BURST_REPS = 100_000

PREFIX = "SPARSERL_"
OTHER_VARIABLES = ("SPARSERL_SHARED",)  # benchmarks/: the folder of the real matrices
OTHER_PREFIXES = ("SPARSERL_TEST_",)  # the test suite's own


class ConfigWarning(UserWarning):
    """An environment variable that looks like a setting is none."""


# ---------------------------------------------------------------------------- value kinds

@dataclass(frozen=True)
class Kind:
    """What a setting takes: ``expected`` (said in errors), ``check`` (of a value given in
    code) and ``read`` (the text of its environment variable to a value; ValueError if not)."""

    expected: str
    check: Callable[[Any], bool]
    read: Callable[[str], Any]
    type_error: bool = False  # a value of the wrong type raises TypeError (ValueError otherwise)
    low: float | None = None  # a number's range (said in ``expected``): from low (excluded with
    high: float | None = None  # ``above``) to high
    above: bool = False


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _read_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(text)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


BOOL = Kind("a boolean (1/0, true/false, yes/no, on/off)", lambda v: isinstance(v, bool), _read_bool,
            type_error=True)


def one_of(choices: tuple[str, ...], *, optional: bool = False) -> Kind:
    return Kind(f"one of {choices}", lambda v: v in choices or (optional and v is None),
                lambda text: _choose(text, choices))


def _choose(text: str, choices: tuple[str, ...]) -> str:
    word = text.strip().lower()
    if word not in choices:
        raise ValueError(text)
    return word


def _bound(value: float) -> str:
    """A bound as people write it: 1048576, not 1.04858e+06; 0.1, not 0.1000000000000000055."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def number(noun: str, lo: float, hi: float, *, above: bool = False) -> Kind:
    """A finite number from ``lo`` (excluded with ``above``) to ``hi``: NaN, infinities and
    values past the bounds are refused, read or given in code."""
    low = (lambda v: v > lo) if above else (lambda v: v >= lo)
    return Kind(f"{noun} {'>' if above else '>='} {_bound(lo)} and <= {_bound(hi)}",
                lambda v: _is_number(v) and (isinstance(v, int) or math.isfinite(v)) and low(v) and v <= hi, float,
                low=lo, high=hi, above=above)


def whole(noun: str, lo: int, hi: int) -> Kind:
    """A whole number from ``lo`` to ``hi``."""
    return Kind(f"{noun} >= {lo} and <= {hi}", lambda v: _is_whole(v) and lo <= v <= hi,
                lambda text: int(text.strip()), low=lo, high=hi)


FOLDER = Kind("a folder path", lambda v: v is None or isinstance(v, (str, os.PathLike)), Path)
OPTIONAL_BOOL = Kind("a bool or None", lambda v: v is None or isinstance(v, bool), _read_bool, type_error=True)


def setting(default, kind: Kind):
    """A field of a settings group: its default and what it takes."""
    return field(default=default, metadata={"kind": kind})


class _Group:
    """A frozen settings group: every field checked on creation, ``replace`` refusing
    unknown names."""

    def __post_init__(self):
        for f in fields(self):
            kind = f.metadata.get("kind")
            value = getattr(self, f.name)
            if kind is not None and not kind.check(value):
                error = TypeError if kind.type_error else ValueError
                raise error(f"{type(self).__name__}: {f.name} must be {kind.expected} (got {value!r})")

    @classmethod
    def names(cls) -> list[str]:
        return sorted(f.name for f in fields(cls) if f.init)

    def replace(self, what: str | None = None, **changes):
        """A copy with ``changes``; an unknown name is a TypeError listing the valid ones."""
        refuse_unknown(what or type(self).__name__, changes, self.names())
        return dataclasses.replace(self, **changes)


def refuse_unknown(what: str, given, valid, *, also: str = "") -> None:
    """TypeError naming the names of ``given`` that are not ``valid``, and the valid ones."""
    unknown = sorted(name for name in given if name not in valid)
    if unknown:
        hints = "".join(f"; {name!r}: did you mean {close[0]!r}?" for name in unknown
                        if (close := difflib.get_close_matches(name, valid, n=1)))
        raise TypeError(f"{what}: unknown setting(s) {unknown}; expected some of {sorted(valid)}{also}{hints}")


# ---------------------------------------------------------------------------- the groups

@dataclass(frozen=True)
class JitOptions(_Group):
    """The JIT runtime's settings:
    ``runtime.configure(mode="sync")``, or the ``SPARSERL_JIT*`` variables."""

    mode: str = setting(DEFAULT_JIT_MODE, one_of(MODES))
    """``background``: cuSPARSE serves while a kernel is specialized in a thread; ``sync``:
    specialize before returning; ``off``: always cuSPARSE."""

    strict: bool = setting(DEFAULT_STRICT, BOOL)
    """Raise instead of falling back after a failure (tests): in the runtime, and in the
    backend's routing of raw sparse products unless the model's options say otherwise. A
    decision that cuSPARSE is faster is not a failure."""

    margin: float = setting(DEFAULT_JIT_MARGIN, number("a number", 1.0, MAX_JIT_MARGIN))
    """Install a kernel only when it is at least this much faster than cuSPARSE."""

    budget_s: float = setting(DEFAULT_JIT_BUDGET_S, number("a number of seconds", 0.0, MAX_JIT_BUDGET_S, above=True))
    """Autotuning budget per key, in seconds."""

    policy: str = setting(DEFAULT_JIT_POLICY, one_of(POLICIES))
    """Where candidates come from: ``learned`` (the shipped policy's ``k`` samples; the
    autotuner when no checkpoint loads) or ``autotune`` (the family grid under the budget).
    Part of the cache key, with the checkpoint's hash."""

    k: int = setting(DEFAULT_JIT_K, whole("a whole number", 1, MAX_K))
    """Candidates the learned policy proposes per key (its K likeliest kernels)."""

    idle_s: float = setting(DEFAULT_JIT_IDLE_S, number("a number of seconds", 0.0, MAX_JIT_IDLE_S))
    """Seconds without a specialization after which the specializer's worker process (the
    sandbox, with the policy on the GPU) is stopped, giving back its GPU memory and context;
    the next specialization starts it again, in the background. 0: keep it for the runtime's life."""

    admit_calls: int = setting(DEFAULT_JIT_ADMIT_CALLS, whole("a whole number", 1, MAX_JIT_ADMIT_CALLS))
    """The call of a product (pattern, op, N, dtype) on which its decision starts: the calls
    before are cuSPARSE's, and cost no fingerprint, cache lookup nor search, so that a pattern
    used once or twice (a mini-batch's sampled subgraph) never pays for a decision. 1: on its
    first call. Compile-time decisions (``prespecialize``) do not wait."""

    admit_age_s: float = setting(DEFAULT_JIT_ADMIT_AGE_S, number("a number of seconds", 0.0, MAX_JIT_ADMIT_AGE_S))
    """In background mode, the age a pattern must reach (seconds since it was first seen) before
    its products are decided: calls before are cuSPARSE's and leave no decision record, no C++
    entry and nothing queued, so that a pattern that lives for one training step (a sampled
    subgraph) costs no more than its products. Sync mode and compile-time decisions do not wait."""

    queue: int = setting(DEFAULT_JIT_QUEUE, whole("a whole number", 1, MAX_JIT_QUEUE))
    """Decisions that may wait for the background thread. When that many wait, a new product
    is not queued: cuSPARSE serves it, and a later call asks again. Compile-time decisions are
    always queued (a graph recorded for CUDA graphs waits for them)."""

    class_after: int = setting(DEFAULT_JIT_CLASS_AFTER, whole("a whole number", 0, MAX_JIT_CLASS_AFTER))
    """In background mode, the young patterns (see ``admit_age_s``) of one class after which the
    class is decided: one kernel, searched on one of its patterns and checked on two more, then
    serves every young pattern of the class (:mod:`torch_sparserl.jit.classes`). 0: young
    patterns are always cuSPARSE's."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JitOptions:
        """The defaults, overridden by the ``SPARSERL_JIT*`` variables of ``environ``."""
        return _group_from_environment("jit", environ)


@dataclass(frozen=True)
class BackendOptions(_Group):
    """Options of the ``sparserl`` backend, for one compiled model:
    ``torch.compile(model, backend="sparserl", options={"fuse_epilogues": True})``.
    No environment variable sets them."""

    strict: bool | None = setting(DEFAULT_BACKEND_STRICT, OPTIONAL_BOOL)
    """Raise where this model's raw sparse products, routed to the sparserl operators, would fall
    back to torch's own kernels. None: as the runtime's ``jit.strict``."""

    intercept_sparse: bool = setting(DEFAULT_INTERCEPT_SPARSE, BOOL)
    """Route eager products of raw ``torch.sparse_csr`` tensors, which Dynamo cannot trace,
    to the sparserl operators while a model compiled with this backend runs."""

    prespecialize: bool = setting(DEFAULT_PRESPECIALIZE, BOOL)
    """Start specializing the kernels of the graph's CSRMatrix inputs (module buffers,
    constants, arguments) at compile time, for the product and its backward. How (in the
    background, or before compilation returns) is the JIT runtime's ``mode``."""

    fuse_epilogues: bool = setting(DEFAULT_FUSE_EPILOGUES, BOOL)
    """Fuse the row scaling, bias add and ReLU that follow a sparse product into its kernel
    where the installed kernel can store rows through them (the post-grad pass writes
    ``sparserl::spmm_epilogue``). Off by default: no gain was measured
    (``benchmarks/bench_epilogue.py``; ``bench_gnn.py`` way ``sparserl_fused``)."""

    direct_ops: bool = setting(DEFAULT_DIRECT_OPS, BOOL)
    """Run the sparse products of compiled graphs as ``sparserl_direct::*``, the operators'
    implementation-only twins, instead of through custom_op's autograd layers, which an
    already differentiated graph does not need (``ops.DIRECT_OPS``). Off: for comparisons."""

    fast_path: bool = setting(DEFAULT_FAST_PATH, BOOL)
    """With ``direct_ops``, run the products as ``sparserl_fast::*``, which C++ serves once
    :mod:`torch_sparserl.jit.fastpath` is built and loaded (the backend starts that: a subprocess
    builds it once per machine, in the background) and the Python implementation has served
    the same call. Off: for comparisons. ``fast_path.enabled`` off turns it off for the process."""

    flatten_matrices: bool = setting(DEFAULT_FLATTEN_MATRICES, BOOL)
    """Give AOTAutograd a graph's CSRMatrix inputs as their parts (``crow``, ``col``,
    ``val``) instead of a tensor subclass it unwraps on every call (:mod:`torch_sparserl.compiler.flatten`;
    matrices whose values need a gradient keep the subclass path). Off: for comparisons."""

    inductor: tuple[tuple[str, Any], ...] = ()
    """Inductor's own options, passed on as its config patches: any option that is not one of
    the above and names an entry of ``torch._inductor.config`` (``"cpp_wrapper"``,
    ``"max_autotune"``, ``"triton.cudagraphs"``), as the ``inductor`` backend takes them."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | BackendOptions | None) -> BackendOptions:
        """The options of ``torch.compile(options=...)``: the backend's own, and Inductor's
        config entries; any other name is refused, naming the valid ones."""
        if options is None:
            return cls()
        if isinstance(options, BackendOptions):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"sparserl backend: options must be a dict (got {type(options).__name__})")
        known = [name for name in cls.names() if name != "inductor"]
        ours = {name: value for name, value in options.items() if name in known}
        for name, value in ours.items():
            if not isinstance(value, bool):
                raise TypeError(f"sparserl backend: option {name!r} must be a bool (got {value!r})")
        inductor = _inductor_options({name: value for name, value in options.items() if name not in known}, known)
        return cls(**ours, inductor=inductor)


def _inductor_options(options: Mapping[str, Any], ours: list[str]) -> tuple[tuple[str, Any], ...]:
    """The options that name Inductor config entries, checked as ``torch.compile`` checks the
    ``inductor`` backend's: the name must exist and the value have its type."""
    if not options:
        return ()
    from torch._inductor import config

    current = config.get_config_copy()
    unknown = sorted(name for name in options if name.replace("-", "_") not in current)
    if unknown:
        hints = "".join(f"; {name!r}: did you mean {close[0]!r}?" for name in unknown
                        if (close := difflib.get_close_matches(name, ours, n=1)))
        raise ValueError(f"sparserl backend: unknown option(s) {unknown}; expected some of {sorted(ours)} "
                         f"or an entry of torch._inductor.config{hints}")
    patches = []
    for name, value in options.items():
        key = name.replace("-", "_")
        expected = config.get_type(key) if hasattr(config, "get_type") else None
        if isinstance(expected, type) and not isinstance(value, expected):
            raise TypeError(f"sparserl backend: Inductor option {name!r} must be a {expected.__name__} "
                            f"(got {value!r})")
        patches.append((key, value))
    return tuple(sorted(patches))


@dataclass(frozen=True)
class CacheOptions(_Group):
    """The kernel cache on disk (:class:`~torch_sparserl.jit.cache.KernelCache`)."""

    dir: Path | str | None = setting(DEFAULT_CACHE_DIR, FOLDER)
    """The folder of the cache (decisions, built libraries and cubins), private to the user.
    None: ``$XDG_CACHE_HOME/torch_sparserl``, else ``~/.cache/torch_sparserl``."""

    max_mb: float = setting(DEFAULT_CACHE_MAX_MB, number("a number of megabytes", MIN_CACHE_MAX_MB, MAX_CACHE_MAX_MB))
    """The most the decisions on disk may take: a write past it removes the least recently
    used ones (``sparserl cache prune`` does it on demand)."""

    cubins: bool = setting(DEFAULT_CACHE_CUBINS, BOOL)
    """Keep NVRTC's builds in ``<dir>/cubins``, signed with the user's key, so that a kernel
    source compiled once on the machine is loaded after (:mod:`torch_sparserl.toolchain.cubins`)."""


@dataclass(frozen=True)
class FastPathOptions(_Group):
    """The C++ fast path (:mod:`torch_sparserl.jit.fastpath`), for the whole process."""

    enabled: bool = setting(DEFAULT_FAST_PATH_ENABLED, BOOL)
    """Off: never built nor loaded; compiled products stay on the Python implementation
    whatever the models' ``backend.fast_path`` says."""


@dataclass(frozen=True)
class SpecializerOptions(_Group):
    """Where and how the specializer's worker (the sandbox process) does its work; experiment
    switches, read by the worker and the autotuner."""

    policy_device: str = setting(DEFAULT_POLICY_DEVICE, one_of(POLICY_DEVICES))
    """Where the worker samples the learned policy: ``cuda`` (the GPU when there is one, else
    the host) or ``cpu`` (its small kernels then stay off the GPU that a training loop uses;
    the kernels were decided later that way, and the loop was no faster)."""

    eval_burst_reps: int = setting(DEFAULT_EVAL_BURST_REPS,
                                   whole("a whole number of timed runs", 0, MAX_EVAL_BURST_REPS))
    """Time the runtime's candidate evaluations in bursts of this many runs with 1 ms gaps, so
    that a training loop's kernels can run between them. 0: timing loops back to back (the
    bursts made decisions slower without fewer stalls). Read when the autotuner is imported."""


@dataclass(frozen=True)
class LogOptions(_Group):
    """What the library reports."""

    level: str | None = setting(DEFAULT_LOG_LEVEL, one_of(LOG_LEVELS, optional=True))
    """The level of the ``torch_sparserl`` logger (with a stderr handler), set when the package is
    imported: ``info`` logs the runtime's decisions, ``debug`` more. None: logging's own setting."""

    debug: bool = setting(DEFAULT_DEBUG, BOOL)
    """The ``sparserl`` command shows an error's traceback instead of one line."""


@dataclass(frozen=True)
class Config:
    """Every setting of the library, one group per part."""

    jit: JitOptions = field(default_factory=JitOptions)
    """The JIT runtime (``runtime.configure``; ``SPARSERL_JIT*``)."""

    backend: BackendOptions = field(default_factory=BackendOptions)
    """The defaults of the ``sparserl`` backend's options (per model: ``torch.compile(options=...)``)."""

    cache: CacheOptions = field(default_factory=CacheOptions)
    """The kernel cache on disk."""

    fast_path: FastPathOptions = field(default_factory=FastPathOptions)
    """The C++ fast path."""

    specializer: SpecializerOptions = field(default_factory=SpecializerOptions)
    """The specializer's worker and evaluations."""

    log: LogOptions = field(default_factory=LogOptions)
    """Logs and tracebacks."""


GROUPS: dict[str, type] = {"jit": JitOptions, "backend": BackendOptions, "cache": CacheOptions,
                           "fast_path": FastPathOptions, "specializer": SpecializerOptions, "log": LogOptions}
"""Config's fields and their classes."""


# ---------------------------------------------------------------------------- the environment

@dataclass(frozen=True)
class Variable:
    """An environment variable: the field it sets (``"group.field"``) and how its text reads."""

    name: str
    path: str

    @property
    def kind(self) -> Kind:
        group, name = self.path.split(".")
        return next(f for f in fields(GROUPS[group]) if f.name == name).metadata["kind"]

    def parse(self, text: str):
        """The value of ``text``; ValueError naming the variable, what it expects and what came."""
        kind = self.kind
        try:
            value = kind.read(text)
        except ValueError:
            value = _BAD
        if value is _BAD or not kind.check(value):
            raise ValueError(f"{self.name}: expected {kind.expected} (got {text!r})") from None
        return value


_BAD = object()

ENVIRONMENT: dict[str, Variable] = {v.name: v for v in (
    Variable("SPARSERL_JIT", "jit.mode"),
    Variable("SPARSERL_JIT_STRICT", "jit.strict"),
    Variable("SPARSERL_JIT_MARGIN", "jit.margin"),
    Variable("SPARSERL_JIT_BUDGET_S", "jit.budget_s"),
    Variable("SPARSERL_JIT_POLICY", "jit.policy"),
    Variable("SPARSERL_JIT_K", "jit.k"),
    Variable("SPARSERL_JIT_IDLE_S", "jit.idle_s"),
    Variable("SPARSERL_JIT_ADMIT_CALLS", "jit.admit_calls"),
    Variable("SPARSERL_JIT_ADMIT_AGE_S", "jit.admit_age_s"),
    Variable("SPARSERL_JIT_QUEUE", "jit.queue"),
    Variable("SPARSERL_JIT_CLASS_AFTER", "jit.class_after"),
    Variable("SPARSERL_CACHE_DIR", "cache.dir"),
    Variable("SPARSERL_CACHE_MAX_MB", "cache.max_mb"),
    Variable("SPARSERL_CACHE_CUBINS", "cache.cubins"),
    Variable("SPARSERL_FAST_PATH", "fast_path.enabled"),
    Variable("SPARSERL_POLICY_DEVICE", "specializer.policy_device"),
    Variable("SPARSERL_EVAL_BURST_REPS", "specializer.eval_burst_reps"),
    Variable("SPARSERL_LOG", "log.level"),
    Variable("SPARSERL_DEBUG", "log.debug"),
)}
"""Every environment variable of the library: name -> the field it sets and its parser."""

_BY_PATH = {v.path: v for v in ENVIRONMENT.values()}


def _value(variable: Variable, environ: Mapping[str, str]):
    text = environ.get(variable.name)
    if text is None or not text.strip():
        return _BAD
    return variable.parse(text)


def _group_from_environment(group: str, environ: Mapping[str, str] | None):
    environ = os.environ if environ is None else environ
    changes = {}
    for variable in ENVIRONMENT.values():
        if variable.path.startswith(group + "."):
            value = _value(variable, environ)
            if value is not _BAD:
                changes[variable.path.split(".")[1]] = value
    return GROUPS[group](**changes)


def from_environment(environ: Mapping[str, str] | None = None, *, warn: bool = True) -> Config:
    """The defaults, overridden by the variables of ``environ`` (default: ``os.environ``), read
    now; with ``warn``, an unknown ``SPARSERL_*`` variable is warned about (once)."""
    environ = os.environ if environ is None else environ
    if warn:
        warn_unknown_variables(environ)
    return Config(**{group: _group_from_environment(group, environ) for group in GROUPS})


def read(path: str, environ: Mapping[str, str] | None = None):
    """One field's value (``"cache.dir"``): its variable's, read now, else the default."""
    group, name = path.split(".")
    variable = _BY_PATH.get(path)
    value = _BAD if variable is None else _value(variable, os.environ if environ is None else environ)
    if value is _BAD:
        return next(f.default for f in fields(GROUPS[group]) if f.name == name)
    return value


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``SPARSERL_*`` names of ``environ`` that the library does not know."""
    environ = os.environ if environ is None else environ
    return sorted(name for name in environ if name.startswith(PREFIX) and name not in ENVIRONMENT
                  and name not in OTHER_VARIABLES and not name.startswith(OTHER_PREFIXES))


_warned: set[str] = set()


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn (a :class:`ConfigWarning`) about the unknown ``SPARSERL_*`` variables not warned
    about before in this process; returns them."""
    new = [name for name in unknown_variables(environ) if name not in _warned]
    if new:
        _warned.update(new)
        hints = "".join(f" ({name}: did you mean {close[0]}?)" for name in new
                        if (close := difflib.get_close_matches(name, list(ENVIRONMENT), n=1)))
        warnings.warn(f"torch_sparserl: unknown environment variable(s) {', '.join(new)}, ignored{hints}; "
                      f"the known ones are {', '.join(ENVIRONMENT)}", ConfigWarning, stacklevel=2)
    return new


# ---------------------------------------------------------------------------- the logger

logger = logging.getLogger("torch_sparserl")

try:
    _level = read("log.level")
except ValueError:
    # Not raised from ``import torch_sparserl``, where it would be a traceback before the
    # ``sparserl`` command could say it in one line: the settings are read whole, and this one
    # refused, when the runtime is created (the first product, ``configure``) and by every
    # command. Logging is left as it is meanwhile.
    _level = None
if _level is not None:
    logging.basicConfig()
    logger.setLevel(_level.upper())
