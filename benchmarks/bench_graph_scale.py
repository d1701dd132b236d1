"""A big graph on one machine: generate, ingest from parquet edge files, train, infer.

Every step is a real command, run under :class:`process_memory.RSSSampler` (peak resident
memory of the whole process tree, sampled every 0.5 s):

1. *Generate* (reused when ``metadata.json`` records the same spec): ``generate_graph`` through
   its Python API in a child process (the CLI's ``embedtrain datagen graph --nodes N --edges E
   --feature-dim F --feature-dtype float16 --memory-gb M`` with valid and test splits of
   ``--eval-fraction`` each, so that the final evaluation reads a sample, not 20% of the nodes):
   edges drawn in chunks of 2^26 into the out-of-core CSR build, features written to a memory map.
2. *Edge files*: the graph's distinct edges (``u < v``) written to parquet files of 2^25 rows
   (``src, dst`` int64, in CSR order, a block of rows at a time): the input of step 3.
3. *Ingest* (timed; the record's ``ingest_s`` and ``ingest_peak_rss_gb``): ``embedtrain ingest``
   with an edges-only spec (integer ids, ``graph.memory_gb: M``) on those files: checks and
   counts, the id remap (Polars joins), and the CSR build, out of core when the edges need more
   than ``M``. Its output is deleted after its size is measured (``--keep-ingested`` keeps it);
   training reads the generated set (the same graph with its node ids renumbered by first
   appearance).
4. *Train*: ``embedtrain train configs/gnn_node.yaml`` on the generated set for ``--steps``
   steps of ``--batch`` seeds (no periodic evaluation or checkpoint; the final evaluation reads
   the small valid and test splits), a GraphSAGE on the float16 features with no node-id table
   (``gnn.embedding_dim: 0``), or with ``--node-table`` ``configs/gnn_node_100m.yaml``'s dynamic
   node-id table of 10M rows.
   ``train_seeds_per_s`` is the trainer's ``train_examples_per_s``.
5. *Layer-wise inference* on ``--infer-nodes`` random nodes (:mod:`embedtrain.models.layerwise`):
   the trained model's final outputs computed layer by layer over full neighbourhoods.

Usage:
    python benchmarks/bench_graph_scale.py --nodes 20000000 --edges 200000000 \\
        --json benchmarks/out/graph_scale_20m.json [--work /tmp/embedtrain_graph_scale] \\
        [--memory-limit-gb 14.9] [--skip-ingest | --skip-train] [--skip-infer]

``--skip-ingest`` leaves out steps 2 and 3, ``--skip-train`` steps 4 and 5, ``--skip-infer`` step 5
(their keys are then absent from the JSON).

``--memory-limit-gb G`` runs the whole benchmark (this process and every step's) in a Linux
memory cgroup of ``G`` GiB (:mod:`memory_cgroup`): the kernel then holds anonymous memory and
the page cache the steps fill, memory-mapped files included, under ``G`` together, reclaiming
clean file pages first; each step records the cgroup's peak (``cgroup.peak_gb``) and OOM kills.
Before each step the work folder's files are dropped from the page cache, so that the pages the
step reads are charged to the cgroup (a page stays charged to the cgroup that first read it).

The JSON is rewritten after every step (``"complete": false`` until the last), so a run cut short
keeps what it measured.

JSON keys: ``nodes``, ``edges``, ``ingest_s``, ``ingest_peak_rss_gb``, ``train_seeds_per_s``,
``train_peak_rss_gb``, ``disk_gb`` (the generated data set, the parquet edges, and the ingested
set), and per step its command, wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_cgroup import MemoryLimit  # noqa: E402
from process_memory import run_sampled  # noqa: E402

LIMIT: "MemoryLimit | None" = None  # --memory-limit-gb: this process's cgroup

PY = sys.executable
SPEC = """kind: graph
name: scale
id_type: integer
edges: {{format: parquet, src: src, dst: dst}}
graph: {{directed: false, self_loops: drop, duplicates: drop, memory_gb: {memory_gb}}}
split: {{valid_fraction: 0.0005, test_fraction: 0.0005}}
"""


def du_gb(path: Path) -> float:
    """Bytes on disk under ``path`` (allocated blocks: sparse files count what they hold), GiB."""
    total = 0
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            total += p.stat().st_blocks * 512
    return round(total / 2**30, 3)


def step(name: str, cmd: list[str], log_dir: Path, record: dict) -> dict:
    if LIMIT is not None:  # every page the step reads is charged to the limit
        LIMIT.evict(log_dir.parent)
        LIMIT.reset_peak()
    status, wall, memory = run_sampled(cmd, log_dir / f"{name}.log")
    cgroup = LIMIT.usage() if LIMIT is not None else None
    if status != 0:
        tail = (log_dir / f"{name}.log").read_text()[-2000:]
        record["steps"][name] = {"command": " ".join(cmd), "exit_status": status,
                                 "cgroup": cgroup}
        save(record)
        raise SystemExit(f"{name} failed (exit {status}; memory cgroup: {cgroup}); the end of "
                         f"its log:\n{tail}")
    out = {"command": " ".join(cmd), "wall_s": round(wall, 1),
           "peak_rss_gb": memory["peak_tree_rss_gb"],
           "peak_anon_gb": memory.get("peak_tree_anon_gb"),
           "min_available_gb": memory.get("min_mem_available_gb"), "cgroup": cgroup}
    record["steps"][name] = out
    print(f"  {name}: {wall:.1f} s, peak RSS {out['peak_rss_gb']:.2f} GiB (anonymous "
          f"{out['peak_anon_gb']} GiB)" + (f", cgroup peak {cgroup['peak_gb']} of "
                                           f"{cgroup['limit_gb']} GiB" if cgroup else ""),
          flush=True)
    save(record)
    return out


def save(record: dict) -> None:
    """Writes ``record`` to its JSON file (``record["json"]``) now."""
    path = Path(record["json"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def generate(args: argparse.Namespace, graph: Path, log_dir: Path, record: dict) -> None:
    spec = dict(nodes=args.nodes, avg_degree=2 * args.edges / args.nodes,
                feature_dim=args.feature_dim, valid_fraction=args.eval_fraction,
                test_fraction=args.eval_fraction, seed=args.seed)
    meta = graph / "metadata.json"
    if meta.exists():
        old = json.loads(meta.read_text()).get("generator", {}).get("spec", {})
        if all(old.get(k) == v for k, v in spec.items()) and old.get("feature_dtype") == "float16":
            print(f"reusing {graph}", flush=True)
            record["steps"]["generate"] = {"reused": str(graph)}
            return
    code = ("from embedtrain.datagen import GraphDataSpec, generate_graph; "
            "from embedtrain.graph.store import FeatureDtype; "
            f"generate_graph(GraphDataSpec(**{spec!r}, feature_dtype=FeatureDtype.FLOAT16), "
            f"{str(graph)!r}, progress=False, memory_gb={args.memory_gb!r})")
    step("generate", [PY, "-c", code], log_dir, record)


def edge_files(graph: Path, out: Path, record: dict) -> None:
    """The distinct edges ``u < v`` as parquet files of 2^25 rows (skipped when present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from embedtrain.graph.csr import row_blocks
    from embedtrain.graph.store import load_graph

    done = out / "_SUCCESS"
    if done.exists():
        print(f"reusing {out}", flush=True)
        return
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    g = load_graph(graph, check_ranges=False)
    if LIMIT is not None:
        LIMIT.reset_peak()
    t0, part, rows = time.perf_counter(), 0, 0
    buf_s, buf_d, held = [], [], 0

    def flush() -> None:
        nonlocal part, buf_s, buf_d, held
        if held:
            pq.write_table(pa.table({"src": np.concatenate(buf_s), "dst": np.concatenate(buf_d)}),
                           out / f"part-{part:05d}.parquet")
            part, buf_s, buf_d, held = part + 1, [], [], 0

    for lo, hi in row_blocks(g.indptr, 1 << 24):
        r = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(g.indptr[lo:hi + 1]))
        c = np.asarray(g.indices[g.indptr[lo]:g.indptr[hi]]).astype(np.int64)
        keep = r < c
        buf_s.append(r[keep])
        buf_d.append(c[keep])
        held += int(keep.sum())
        rows += int(keep.sum())
        if held >= 1 << 25:
            flush()
    flush()
    done.write_text("")
    record["steps"]["edge_files"] = {"files": part, "rows": rows,
                                     "wall_s": round(time.perf_counter() - t0, 1),
                                     "cgroup": LIMIT.usage() if LIMIT is not None else None}
    save(record)
    print(f"  edge files: {part} files, {rows:,} rows, {time.perf_counter() - t0:.1f} s",
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--edges", type=int, required=True, help="undirected edges drawn")
    p.add_argument("--json", required=True)
    p.add_argument("--work", default="/tmp/embedtrain_graph_scale")
    p.add_argument("--feature-dim", type=int, default=64)
    p.add_argument("--eval-fraction", type=float, default=0.0005,
                   help="share of the nodes in each of valid and test")
    p.add_argument("--memory-gb", type=float, default=4.0,
                   help="graph.memory_gb of generation and ingestion")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--node-table", action="store_true",
                   help="train configs/gnn_node_100m.yaml (a dynamic node-id table of 10M rows) "
                        "instead of configs/gnn_node.yaml without a node-id table")
    p.add_argument("--infer-nodes", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-ingested", action="store_true")
    p.add_argument("--skip-infer", action="store_true", help="leave out step 5")
    p.add_argument("--skip-ingest", action="store_true",
                   help="leave out steps 2 and 3 (train on the generated set as always)")
    p.add_argument("--skip-train", action="store_true",
                   help="leave out steps 4 and 5 (generate and ingest only)")
    p.add_argument("--memory-limit-gb", type=float, default=0.0,
                   help="run every step in a memory cgroup of this many GiB (page cache "
                        "included; 0: no limit)")
    args = p.parse_args()
    global LIMIT
    if args.memory_limit_gb:
        LIMIT = MemoryLimit(args.memory_limit_gb)

    work = Path(args.work) / f"n{args.nodes}_e{args.edges}_f{args.feature_dim}"
    graph, edges, ingested, run = work / "graph", work / "edges", work / "ingested", work / "run"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record: dict = {"date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
                    "nodes": args.nodes, "edges": args.edges, "feature_dim": args.feature_dim,
                    "feature_dtype": "float16", "memory_gb": args.memory_gb, "steps": {},
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "json": args.json, "complete": False,
                    "memory_limit_gb": args.memory_limit_gb or None}
    print(f"graph scale: {args.nodes:,} nodes, {args.edges:,} edges, {args.feature_dim} float16 "
          f"features; work folder {work}", flush=True)

    generate(args, graph, logs, record)
    meta = json.loads((graph / "metadata.json").read_text())
    record["csr_entries"] = meta["num_edges"]
    record["generator"] = {k: meta["generator"][k] for k in ("homophily", "edge_counts",
                                                             "one_hop_bayes_accuracy")}
    report: dict = {}
    disk = {"generated": du_gb(graph)}
    if not args.skip_ingest:
        edge_files(graph, edges, record)
        report = ingest(args, work, edges, ingested, logs, record)
        disk.update(edge_files=du_gb(edges), ingested=du_gb(ingested))
        if not args.keep_ingested:
            shutil.rmtree(ingested)

    if args.skip_train:
        record["disk_gb"] = {**disk, "total": round(sum(disk.values()), 3)}
        return finish(args, record, report)
    config = "configs/gnn_node_100m.yaml" if args.node_table else "configs/gnn_node.yaml"
    train = [PY, "-m", "embedtrain", "train", config, "--out", str(run),
             "--overwrite", "--no-progress", "--set", f"data.path={graph}",
             "--set", f"data.batch_size={args.batch}", "--set", f"train.max_steps={args.steps}",
             "--set", "train.epochs=1000", "--set", "train.eval_every=0",
             "--set", "train.checkpoint_every=0", "--set", "train.progress=false"]
    if not args.node_table:
        train += ["--set", "gnn.embedding_dim=0"]
    tr = step("train", train, logs, record)
    summary = json.loads((run / "summary.json").read_text())
    record["train_seeds_per_s"] = round(summary["train_examples_per_s"], 1)
    record["train_peak_rss_gb"] = tr["peak_rss_gb"]
    record["train_summary"] = {k: summary.get(k) for k in (
        "steps", "examples", "train_time_s", "peak_rss_gb_per_rank", "accuracy", "macro_f1")}
    if not args.skip_infer:
        infer(args, run, graph, logs, record)
    record["disk_gb"] = {**disk, "total": round(sum(disk.values()), 3)}
    return finish(args, record, report)


def ingest(args: argparse.Namespace, work: Path, edges: Path, ingested: Path, logs: Path,
           record: dict) -> dict:
    """Step 3: ``embedtrain ingest`` of the edge files; its report."""
    spec = work / "ingest.yaml"
    spec.write_text(SPEC.format(memory_gb=args.memory_gb))
    ing = step("ingest", [PY, "-m", "embedtrain", "ingest", str(spec), "--input", str(edges),
                          "--out", str(ingested), "--overwrite"], logs, record)
    report = json.loads((ingested / "ingest_report.json").read_text())
    record["ingest_s"] = ing["wall_s"]
    record["ingest_peak_rss_gb"] = ing["peak_rss_gb"]
    record["ingest_report"] = {k: report[k] for k in ("csr_build", "peak_rss_gb", "phases")}
    record["ingest_report"]["edges_stored"] = report["edges"]["edges_stored"]
    return report


def infer(args: argparse.Namespace, run: Path, graph: Path, logs: Path, record: dict) -> None:
    infer_code = ("import json, sys; sys.path.insert(0, 'benchmarks'); "
                  "from graph_scale_infer import infer; "
                  f"print(json.dumps(infer({str(run)!r}, {str(graph)!r}, {args.infer_nodes})))")
    inf = step("infer", [PY, "-c", infer_code], logs, record)
    line = (logs / "infer.log").read_text().strip().splitlines()[-1]
    record["inference"] = {**json.loads(line), "peak_rss_gb": inf["peak_rss_gb"]}


def finish(args: argparse.Namespace, record: dict, report: dict) -> int:
    record["complete"] = True
    save(record)
    rows = [("nodes", f"{args.nodes:,}"), ("edges drawn", f"{args.edges:,}"),
            ("CSR entries", f"{record['csr_entries']:,}"),
            ("ingest", f"{record['ingest_s']} s, peak RSS {record['ingest_peak_rss_gb']} GiB "
                       f"({report['csr_build']['method']})" if report else "skipped"),
            ("train", f"{record['train_seeds_per_s']} seeds/s, peak RSS "
                      f"{record['train_peak_rss_gb']} GiB" if "train_seeds_per_s" in record
                      else "skipped"),
            ("inference", json.dumps(record.get("inference"))),
            ("disk", f"{record['disk_gb']} GiB")]
    for k, v in rows:
        print(f"{k:>12}  {v}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
