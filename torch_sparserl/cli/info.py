"""``sparserl info``: versions, operators, shipped matrices, the fast path, the runtime's settings and the caches."""

from __future__ import annotations

from .. import config


def info(args) -> int:
    import torch

    import torch_sparserl as ts

    from ..data.datasets import list_matrices

    print(f"torch-sparserl {ts.__version__}, torch {torch.__version__}, "
          f"CUDA {'available: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
    print("operators: " + ", ".join(f"sparserl::{op}" for op in ts.ops.registered_ops()))
    print("shipped matrices: " + ", ".join(list_matrices()))
    print(f"C++ fast path: {ts.jit.fastpath.status()}")
    jit = config.from_environment().jit
    print(f"JIT runtime (from the environment): mode={jit.mode}, policy={jit.policy}, margin={jit.margin}, "
          f"admit_calls={jit.admit_calls}, queue={jit.queue}")
    from ..jit.cache import ENTRY_NAME
    from ..toolchain.paths import configured_cache_dir

    folder = configured_cache_dir() / "kernels"  # read only: info creates nothing
    try:
        sizes = [entry.lstat().st_size for entry in folder.iterdir() if ENTRY_NAME.match(entry.name)]
    except OSError:
        sizes = None
    print(f"kernel cache: {folder}, " + (f"{len(sizes)} entries, {sum(sizes) / 2**20:.2f} MB" if sizes is not None
                                         else "not created yet")
          + f" (at most {config.read('cache.max_mb'):g} MB)")
    from ..toolchain import cubins

    built, size = cubins.count()
    print(f"cubin cache: {configured_cache_dir() / cubins.FOLDER}, " + (
        f"{built} kernels, {size / 2**20:.2f} MB" if config.read("cache.cubins") else "off (SPARSERL_CACHE_CUBINS=0)"))
    return 0


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("info", help="versions, operators and shipped matrices", description=(
        "Versions, the registered operators, the shipped matrices, the C++ fast path's state, the JIT runtime's "
        "settings from the environment, and the caches' folders and sizes."))
    p.set_defaults(run=info)
