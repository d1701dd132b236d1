"""Export and batch scoring of a trained DLRM: table bytes (float32, int8, int4), AUC against
``embedtrain eval``, per-row logits against eval's model, and the export's peak memory.

1. A data set (``embedtrain datagen ctr --rows R``; reused when its ``metadata.json`` is there)
   and a run (``embedtrain train configs/dlrm_synthetic.yaml``, 1 epoch, ``--nproc N``, the
   ``--set`` overrides; reused when its ``summary.json`` is there).
2. ``embedtrain eval RUN --split test``: eval's AUC.
3. For each ``--quantize``: ``export_run`` in a fresh process (as the CLI runs it): wall time and
   the peak RSS of the tables' phase over the baseline before it (``VmHWM``, reset through
   ``/proc/self/clear_refs``), against the largest table; then ``predict`` on the test split in
   another fresh process: rows/s, AUC, log loss, and the bytes the lookup modules hold (TorchRec's
   ``EmbeddingBagCollection``, or the quantized one's FBGEMM rows); for float32, the largest
   ``|logit - eval's logit|`` over the test rows (eval's model: the run rebuilt and restored as
   ``embedtrain eval`` does).

Usage:
    python benchmarks/bench_export.py --rows 300000 --json benchmarks/out/export.json
    python benchmarks/bench_export.py --rows 300000 --out benchmarks/out/export_d64 \\
        --set model.embedding_dim=64 --set model.bottom_mlp=[64,64]   # 4x bigger tables

Prints one table (a row per quantization); JSON: ``runs`` (per quantization: export and predict
figures), ``eval``, ``max_abs_logit_diff``, ``command``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/dlrm_synthetic.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"embedtrain {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r


def _child(*args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"child {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def child_export(run: str, out: str, quantize: str) -> dict[str, Any]:
    from embedtrain.export.export import export_run

    r = export_run(run, out, quantize=quantize, overwrite=True, progress=False)
    m = r.manifest
    return {"seconds": r.seconds, "table_bytes": m.table_bytes, "float32_bytes": m.float32_bytes,
            "largest_table": r.largest_table, "baseline_rss": r.baseline_rss,
            "peak_over_baseline": r.peak_over_baseline}


def child_predict(export: str, data: str, preds: str) -> dict[str, Any]:
    from embedtrain.export.predict import ExportedModel, predict

    memory = ExportedModel(export).table_memory_bytes
    r = predict(export, [str(Path(data) / "test")], preds, progress=False)
    return {"rows": r.rows, "seconds": r.seconds, "rows_per_s": r.rows / r.seconds,
            "table_memory_bytes": memory, **r.metrics}


def child_reference(run: str, preds: str) -> dict[str, Any]:
    """The largest |logit - eval's logit| over the rows of ``preds``."""
    import pyarrow.parquet as pq
    import torch

    from embedtrain.config import load_run_config
    from embedtrain.data.batching import num_padding
    from embedtrain.recipes import build_run

    built = build_run(load_run_config(Path(run) / "config.yaml"), run, progress=False,
                      record_plan=False)
    built.trainer.restore()
    model = built.trainer.model.eval()
    logits = []
    with torch.no_grad():
        for batch in built.eval_reader("test").iter_epoch(0):
            n = batch.labels.shape[0] - num_padding(batch)
            logits.append(model(batch.dense_features, batch.sparse_features).squeeze(-1)[:n])
    ours = torch.from_numpy(pq.read_table(preds).column("logit").to_numpy())
    return {"max_abs_logit_diff": float((torch.cat(logits) - ours).abs().max()),
            "rows": len(ours)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=300_000, help="rows of the data set")
    p.add_argument("--out", default="benchmarks/out/export", help="work directory")
    p.add_argument("--data", help="data set (default: OUT/data, generated)")
    p.add_argument("--nproc", type=int, default=1, help="ranks of the training run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quantize", default="none,int8,int4")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        fn = {"export": child_export, "predict": child_predict,
              "reference": child_reference}[kind]
        print(json.dumps(fn(*rest)))
        return

    work = (ROOT / args.out).resolve()
    data = Path(args.data).resolve() if args.data else work / "data"
    if not (data / "metadata.json").is_file():
        _cli("datagen", "ctr", "--rows", str(args.rows), "--out", str(data))
    run = work / "run"
    if not (run / "summary.json").is_file():
        sets = [a for s in [f"data.path={data}", *args.overrides] for a in ("--set", s)]
        _cli("train", CONFIG, "--out", str(run), "--overwrite", "--no-progress",
             "--nproc", str(args.nproc), *sets)
    evaluated = json.loads(_cli("eval", str(run), "--split", "test").stdout)
    summary = json.loads((run / "summary.json").read_text())

    results: dict[str, Any] = {}
    diff = None
    for q in args.quantize.split(","):
        start = time.perf_counter()
        exported = _child("export", str(run), str(work / f"export_{q}"), q)
        preds = work / f"preds_{q}.parquet"
        scored = _child("predict", str(work / f"export_{q}"), str(data), str(preds))
        results[q] = {"export": exported, "predict": scored,
                      "wall_s": time.perf_counter() - start}
        if q == "none":
            diff = _child("reference", str(run), str(preds))["max_abs_logit_diff"]

    mib = 2**20
    print(f"run: {run} ({summary['steps']} steps, {args.nproc} rank(s)), eval AUC on test "
          f"{evaluated['auc']:.6f}; float32 logits vs eval's: max |diff| {diff:.2e}")
    print(f"{'tables':<8} {'MiB':>8} {'x smaller':>9} {'in memory':>10} {'export s':>8} "
          f"{'peak+ MiB':>9} {'largest':>8} {'rows/s':>9} {'AUC':>9} {'dAUC':>9}")
    base_auc = results.get("none", {}).get("predict", {}).get("auc")
    for q, r in results.items():
        e, s = r["export"], r["predict"]
        d = s["auc"] - base_auc if base_auc is not None else float("nan")
        print(f"{q:<8} {e['table_bytes'] / mib:8.1f} {e['float32_bytes'] / e['table_bytes']:9.2f} "
              f"{s['table_memory_bytes'] / mib:10.1f} {e['seconds']:8.1f} "
              f"{e['peak_over_baseline'] / mib:9.1f} {e['largest_table'] / mib:8.1f} "
              f"{s['rows_per_s']:9,.0f} {s['auc']:9.6f} {d:+9.6f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
            "eval": evaluated, "max_abs_logit_diff": diff, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
