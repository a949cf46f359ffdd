"""The benchmarks' common core; each script imports what it shares from here, never from
another script.

* :mod:`.environment` — the machine: GPU, driver and clocks, torch, CPU, commit, memory;
* :mod:`.matrices` — the real matrices (``$SPARSERL_SHARED``, ``../shared/matrices``,
  ``shared/matrices``), the shipped and the synthetic ones, graphs;
* :mod:`.timing` — how a call is timed (interleaved rounds, host loops, profiler, CUDA events);
* :mod:`.stats` — the geometric mean;
* :mod:`.tables` — Markdown rows, headers and the runs line;
* :mod:`.results` — results files: names, JSON, the summary and the plot beside it;
* :mod:`.plots` — matplotlib figures as SVG (the ``bench`` extra);
* :mod:`.gnn` — GNN models, ways and batches (``from common import gnn``; not re-exported);
* :mod:`.spmv_probe` — the SpMV kernel the x-gather probes vary;
* :mod:`.errors` — bad command-line input.
"""

from .environment import REPO, commit, cpu_model, cuda_available, environment, gpu_slug, nvidia_smi, rss_mb
from .errors import usage_error
from .matrices import (SMALL_SYNTHETIC, SYNTHETIC, MatrixEntry, default_matrix_names, known_matrices, load_graph,
                       matrix_list, select_matrices, shared_matrices_dir)
from .results import dumps, emit_markdown, json_safe, results_path, save_json, write_json_md, write_text_atomic
from .stats import geomean
from .tables import command_line, fmt, header, row, run_bullets, runs_line
from .timing import compare_us, gpu_us, host_us, kernel_us, wall_us

__all__ = ["REPO", "SMALL_SYNTHETIC", "SYNTHETIC", "MatrixEntry", "command_line", "commit", "compare_us", "cpu_model",
           "cuda_available", "default_matrix_names", "dumps", "emit_markdown", "environment", "fmt", "geomean",
           "gpu_slug", "gpu_us", "header", "host_us", "json_safe", "kernel_us", "known_matrices", "load_graph",
           "matrix_list", "nvidia_smi", "results_path", "row", "rss_mb", "run_bullets", "runs_line", "save_json",
           "select_matrices", "shared_matrices_dir", "usage_error", "wall_us", "write_json_md", "write_text_atomic"]
