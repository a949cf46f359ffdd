"""The training-step headline, ``benchmarks/results/headline.json``, from the latest results files.

Reads a ``bench_gnn`` results file (full-graph steps), a ``bench_minibatch`` one and a
``bench_intake`` one, all from GPU runs, and writes the figures issue 52 tracks, each computed
from what those files measured (None where a file lacks the way it needs):

* ``gnn_full_graph`` — over the rows whose graph is in ``--graphs`` (all rows without it): the
  captured way (``sparserl_captured``) against eager ``torch.sparse`` and against PyG's best way
  of the row (geometric means, each graph one mean of its rows), the largest wall / device time
  of the captured way's epoch, and the smallest compiled-over-eager ratio
  (``sparserl_eager`` epoch / ``sparserl`` epoch: 1 or more where compiling costs nothing);
  where the file ran ``sparserl_compiled_captured`` (the compiled model captured the same way),
  ``compiled_captured`` gives its figures against torch and PyG's best over those rows, and the
  smallest ratio of the uncompiled capture's epoch to its;
* ``minibatch`` — the best sparserl way's steady epoch against the best of torch's and PyG's,
  and eager sparserl's first epoch against torch's;
* ``intake_us`` — host µs of ``ts.csr`` of a CUDA subgraph (``cuda_csr``), and whether it
  synchronized (``intake_syncs``); ``intake_us_by_way``, each CUDA way's (a torch CSR tensor, a
  ``(crow, col, val)`` triple).

    python benchmarks/headline.py --gnn benchmarks/results/gnn-h100-....json \\
        --minibatch benchmarks/results/minibatch-....json --intake benchmarks/results/intake-....json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import geomean, save_json  # noqa: E402

TARGET_GRAPHS = ("cora", "pubmed", "musae_github", "twitch_DE", "fb100_Cornell5", "dblp-2010")
SPARSERL_MINIBATCH_WAYS = ("sparserl", "sparserl_classes", "sparserl_compiled", "sparserl_captured")


def _per_graph_geomean(rows: list[dict], key: str) -> float | None:
    per_graph: dict[str, list] = {}
    for row in rows:
        per_graph.setdefault(row["graph"], []).append(row.get(key))
    return geomean(geomean(values) for values in per_graph.values())


def gnn_figures(doc: dict, graphs=TARGET_GRAPHS) -> dict:
    rows = [r for r in doc.get("rows", []) if not graphs or r["graph"] in graphs]
    walls = [r["ways"]["sparserl_captured"].get("wall_over_gpu") for r in rows
             if r["ways"].get("sparserl_captured", {}).get("status") == "ok"]
    compiled = [r["compiled_over_eager"] for r in rows if r.get("compiled_over_eager") is not None]
    figures = {"geomean_vs_torch": _per_graph_geomean(rows, "captured_vs_eager"),
               "geomean_vs_best_pyg": _per_graph_geomean(rows, "captured_vs_best_pyg"),
               "max_wall_over_gpu": max((w for w in walls if w is not None), default=None),
               "compiled_over_eager_min": min(compiled, default=None),
               "graphs": sorted({r["graph"] for r in rows})}
    both = [r for r in rows if r.get("compiled_captured_vs_eager") is not None]
    if both:  # the compiled model captured the same way: the same figures, over the rows that ran it
        figures["compiled_captured"] = {
            "geomean_vs_torch": _per_graph_geomean(both, "compiled_captured_vs_eager"),
            "geomean_vs_best_pyg": _per_graph_geomean(both, "compiled_captured_vs_best_pyg"),
            "over_captured_min": min((r["compiled_captured_over_captured"] for r in both
                                      if r.get("compiled_captured_over_captured") is not None), default=None),
            "graphs": sorted({r["graph"] for r in both})}
    return figures


def minibatch_figures(doc: dict) -> dict:
    rows = {r["way"]: r for r in doc.get("summary", []) if r.get("status") == "ok"}
    steady = {w: r["steady_epoch_s"] for w, r in rows.items() if r.get("steady_epoch_s")}
    ours = [steady[w] for w in SPARSERL_MINIBATCH_WAYS if w in steady]
    theirs = [steady[w] for w in ("torch", "pyg") if w in steady]
    first = {w: r["first_epoch_s"] for w, r in rows.items()}
    return {"steady_vs_best": min(theirs) / min(ours) if ours and theirs else None,
            "first_vs_torch": first["torch"] / first["sparserl"] if "torch" in first and "sparserl" in first else None,
            "graph": doc.get("setup", {}).get("graph")}


def headline(gnn: dict | None, minibatch: dict | None, intake: dict | None, graphs=TARGET_GRAPHS) -> dict:
    docs = [d for d in (gnn, minibatch, intake) if d is not None]
    way = (intake or {}).get("ways", {}).get("cuda_csr", {})
    return {"gnn_full_graph": gnn_figures(gnn, graphs) if gnn is not None else None,
            "minibatch": minibatch_figures(minibatch) if minibatch is not None else None,
            "intake_us": way.get("intake_us"), "intake_syncs": way.get("syncs"),
            "intake_us_by_way": {name: w.get("intake_us") for name, w in (intake or {}).get("ways", {}).items()
                                 if name.startswith("cuda")} or None,
            "device": sorted({d.get("env", {}).get("gpu") or "cpu" for d in docs}),
            "commit": sorted({d.get("env", {}).get("commit") for d in docs if d.get("env", {}).get("commit")}),
            "sources": [d["_path"] for d in docs]}


def _load(path: str | None) -> dict | None:
    if path is None:
        return None
    doc = json.loads(Path(path).read_text())
    doc["_path"] = str(path)
    return doc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gnn", help="a bench_gnn results file")
    parser.add_argument("--minibatch", help="a bench_minibatch results file")
    parser.add_argument("--intake", help="a bench_intake results file")
    parser.add_argument("--graphs", default=",".join(TARGET_GRAPHS),
                        help="the full-graph rows counted (comma-separated; empty: every row)")
    parser.add_argument("--out", default="benchmarks/results/headline.json")
    args = parser.parse_args(argv)
    if not (args.gnn or args.minibatch or args.intake):
        parser.error("give at least one of --gnn, --minibatch, --intake")
    try:
        docs = [_load(p) for p in (args.gnn, args.minibatch, args.intake)]
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read a results file: {exc}")
    result = headline(*docs, graphs=tuple(g for g in args.graphs.split(",") if g))
    save_json(result, args.out)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
