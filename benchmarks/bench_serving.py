"""Serving latency and throughput of an exported demo DLRM: eager vs ``torch.export`` vs
AOTInductor, float32 vs int8 tables, and the raw rows' preprocessing timed on its own.

1. Raw logs (``embedtrain datagen ctr --format tsv --rows R``), ingested with
   ``configs/ingest/criteo_synthetic.yaml`` (vocabularies, log1p, standardisation), and a short
   run of the demo's model (``configs/dlrm_synthetic.yaml``, ``--steps`` steps: latency does not
   depend on how long it trained); each reused when already there.
2. Two exports, ``--quantize none`` and ``int8``, each with ``--aot`` (an AOTInductor package).
3. For each tables x program, in this process, on the test split's rows in the data set's layout:

   * ``eager``: the run's dense ``nn.Module`` (the recipe's, its parameters from the checkpoint),
     ``export``: the ``torch.export`` program (``dense.pt2``), ``aot``: the AOTInductor package
     (``dense.aoti.pt2``); the tables are the export's in each (TorchRec's
     ``EmbeddingBagCollection`` over the float32 rows, or its quantized one, FBGEMM's int8
     kernels);
   * a request is what ``embedtrain predict`` does to a batch: Arrow rows -> TorchRec batch (the
     training reader's code) -> tables -> dense program -> ``sigmoid``;
   * latency: ``--requests`` single-row requests, each timed: p50 and p99 in ms;
   * throughput: rows/s at batch 1, 64 and 1024 (the median of 3 timed passes of at least
     ``--seconds`` each).

4. Preprocessing of raw rows (``embedtrain predict --raw``: ``pipelines.raw_rows``, the data
   set's own ingestion code): rows/s over a raw TSV file of the test rows at batch 1024, and the
   latency of a one-line file (p50/p99), apart from the model's.

Usage:
    python benchmarks/bench_serving.py --json benchmarks/out/serving.json

Prints a table; JSON keys ``latency_ms.{eager,export,aot}.{p50,p99}`` and
``rows_per_s.{eager,export,aot}.{1,64,1024}`` (float32 tables), the same under ``int8``,
``preprocess`` (``rows_per_s``, ``latency_ms``), ``threads``, ``rows``, ``command``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/dlrm_synthetic.yaml"
SPEC = "configs/ingest/criteo_synthetic.yaml"
BATCHES = (1, 64, 1024)
PROGRAMS = ("eager", "export", "aot")


def _cli(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "embedtrain", *args], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"embedtrain {' '.join(args)} failed:\n{r.stderr[-3000:]}")


def prepare(out: Path, rows: int, steps: int) -> tuple[Path, Path, dict[str, Path]]:
    """The raw logs, the ingested data set, the run and its two exports (reused if there)."""
    raw, data, run = out / "raw", out / "data", out / "run"
    if not (raw / "datagen.json").is_file():
        print(f"generating {rows:,} raw TSV rows ...", flush=True)
        _cli("datagen", "ctr", "--rows", str(rows), "--format", "tsv", "--out", str(raw))
    if not (data / "metadata.json").is_file():
        print("ingesting ...", flush=True)
        _cli("ingest", SPEC, "--input", str(raw), "--out", str(data), "--quiet")
    if not (run / "summary.json").is_file():
        print(f"training {steps} steps ...", flush=True)
        _cli("train", CONFIG, "--out", str(run), "--overwrite", "--set", f"data.path={data}",
             "--set", f"train.max_steps={steps}", "--set", "train.eval_every=0",
             "--set", "train.progress=false")
    exports = {}
    for tables in ("fp32", "int8"):
        exports[tables] = out / f"export_{tables}"
        manifest = exports[tables] / "model.json"
        if not (manifest.is_file() and json.loads(manifest.read_text())
                .get("dense_program", {}).get("aot")):
            print(f"exporting {tables} tables with an AOTInductor package ...", flush=True)
            _cli("export", str(run), "--out", str(exports[tables]), "--overwrite", "--aot",
                 "--quantize", "none" if tables == "fp32" else "int8", "--no-progress")
    return raw, run, exports


def eager_dense(run: Path):
    """The run's dense module (the recipe's), its parameters loaded from the newest
    checkpoint: what ``embedtrain export`` exports, left as a module."""
    from embedtrain.config import load_run_config
    from embedtrain.export.programs import model_tables
    from embedtrain.export.tables import load_tensors
    from embedtrain.recipes import recipe_for
    from embedtrain.train.checkpoint import CheckpointManager

    recipe = recipe_for(load_run_config(run / "config.yaml"))
    model = recipe.planning_model()
    parts = recipe.export_parts(model, [(t.name, t.rows, t.dim) for t in model_tables(model)])
    module, prefix = parts.dense.module, parts.dense.checkpoint_prefix
    tensors = {prefix + k: v for k, v in module.state_dict().items()}
    load_tensors(CheckpointManager(run / "checkpoints").latest(), tensors)
    return module.eval()


def scorers(export: Path, program: str, run: Path) -> tuple[Callable, Callable]:
    """A request (Arrow rows in the data set's layout -> click probabilities), and the dense
    program alone on a request's prepared inputs (``prepare(rows)``)."""
    import torch

    from embedtrain.export.predict import ExportedModel, model_batch

    model = ExportedModel(export, program="aot" if program == "aot" else "export")
    if program == "eager":
        model.program = eager_dense(run)

    @torch.no_grad()
    def request(rows):
        batch = model_batch(rows, model.spec)
        return torch.sigmoid(model.outputs(batch.dense_features, batch.sparse_features))

    @torch.no_grad()
    def dense(inputs):
        return model.program(*inputs)

    return request, dense


def dense_inputs(export: Path, rows) -> tuple:
    """The dense program's inputs for ``rows``: ``(dense, pooled)`` as predict makes them."""
    import torch

    from embedtrain.export.predict import ExportedModel, model_batch

    model = ExportedModel(export)
    batch = model_batch(rows, model.spec)
    with torch.no_grad():
        pooled = model.recipe.predict_pooled(model.pooled(batch.sparse_features))
    return (batch.dense_features, *(pooled if isinstance(pooled, tuple) else (pooled,)))


def interleaved_latency_ms(fns: dict[str, Callable], inputs: list) -> dict[str, dict]:
    """Each input timed once per function, the functions taking turns (side by side: the
    machine's noise falls on all alike); p50 and p99 in ms per function."""
    for x in inputs[:20]:
        for fn in fns.values():
            fn(x)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for x in inputs:
        for k, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            times[k].append((time.perf_counter() - start) * 1e3)
    return {k: _percentiles(t) for k, t in times.items()}


def _percentiles(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"p50": statistics.median(times), "p99": times[min(len(times) - 1,
                                                               int(0.99 * len(times)))]}


def latency_ms(fn: Callable, requests: list) -> dict[str, float]:
    return interleaved_latency_ms({"fn": fn}, requests)["fn"]


def interleaved_rows_per_s(fns: dict[str, Callable], table, batch: int, seconds: float
                           ) -> dict[str, float]:
    """Rows/s of each function at ``batch``: the median of 3 rounds, each round one pass of
    ``seconds`` per function, in turn."""
    batches = [table.slice(i, batch) for i in range(0, table.num_rows - batch + 1, batch)][:2000]
    for fn in fns.values():
        for b in batches[:5]:
            fn(b)
    passes: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3):
        for k, fn in fns.items():
            rows, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for b in batches:
                    fn(b)
                    rows += b.num_rows
                    if time.perf_counter() - start >= seconds:
                        break
            passes[k].append(rows / (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in passes.items()}


def preprocessing(export: Path, raw_file: Path, tmp: Path, requests: int) -> dict[str, Any]:
    """Raw TSV rows through the data set's ingestion (``pipelines.raw_rows``): rows/s at batch
    1024 over ``raw_file``, and the latency of a one-line file."""
    import pipelines

    meta = json.loads((export / "dataset_metadata.json").read_text())

    def encode(path: Path, batch: int) -> int:
        rows = pipelines.raw_rows(meta, export, [str(path)])
        return sum(t.num_rows for _, t in rows.batches(batch))

    encode(raw_file, 1024)
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        n = encode(raw_file, 1024)
        passes.append(n / (time.perf_counter() - start))
    one = tmp / "one_line.tsv"
    with open(raw_file) as f:
        one.write_text(f.readline())
    lat = latency_ms(lambda _: encode(one, 1), list(range(requests)))
    return {"rows_per_s": statistics.median(passes), "rows": n, "latency_ms": lat}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/out/serving", help="work directory (reused)")
    p.add_argument("--rows", type=int, default=300_000, help="raw rows to generate")
    p.add_argument("--steps", type=int, default=200, help="training steps of the run")
    p.add_argument("--requests", type=int, default=500, help="single-row requests timed")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per throughput pass")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    raw, run, exports = prepare(out, args.rows, args.steps)
    test = pa.concat_tables(pq.read_table(f) for f in sorted((out / "data" / "test").glob(
        "*.parquet")))
    requests = [test.slice(i, 1) for i in range(args.requests)]
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "rows": test.num_rows}
    configs = [(t, p) for t in exports for p in PROGRAMS]
    built = {c: scorers(exports[c[0]], c[1], run) for c in configs}
    print("timing single-row requests (every configuration in turn) ...", flush=True)
    lat = interleaved_latency_ms({c: built[c][0] for c in configs}, requests)
    thr: dict = {c: {} for c in configs}
    for b in BATCHES:
        print(f"timing throughput at batch {b} ...", flush=True)
        for c, v in interleaved_rows_per_s({c: built[c][0] for c in configs}, test, b,
                                           args.seconds).items():
            thr[c][str(b)] = v
    # the dense program alone (what AOTInductor compiles), on prepared inputs, 1 and 1024 rows
    dense: dict = {}
    for n in (1, 1024):
        distinct = [dense_inputs(exports["fp32"], test.slice(i * n, n))
                    for i in range(min(args.requests // 10, test.num_rows // n))]
        inputs = distinct * (args.requests // len(distinct))
        for p, v in interleaved_latency_ms({p: built[("fp32", p)][1] for p in PROGRAMS},
                                           inputs).items():
            dense.setdefault(p, {})[str(n)] = v
    for tables in exports:
        part = {"latency_ms": {p: lat[(tables, p)] for p in PROGRAMS},
                "rows_per_s": {p: thr[(tables, p)] for p in PROGRAMS}}
        if tables == "fp32":
            result.update(part)
        else:
            result[tables] = part
    result["dense_program_ms"] = dense
    raw_test = sorted(raw.glob("*.tsv"))[-1]
    result["preprocess"] = preprocessing(exports["fp32"], raw_test, out, args.requests // 5)
    result["command"] = "python benchmarks/bench_serving.py " + " ".join(sys.argv[1:])

    print(f"\nserving the demo DLRM ({torch.get_num_threads()} threads; rows in the data set's "
          f"layout -> click probabilities)")
    print(f"{'tables':<7}{'program':<9}{'p50 ms':>9}{'p99 ms':>9}"
          + "".join(f"{f'rows/s @{b}':>15}" for b in BATCHES))
    for tables in ("fp32", "int8"):
        part = result if tables == "fp32" else result[tables]
        for program in PROGRAMS:
            lat, thr = part["latency_ms"][program], part["rows_per_s"][program]
            print(f"{tables:<7}{program:<9}{lat['p50']:>9.3f}{lat['p99']:>9.3f}"
                  + "".join(f"{thr[str(b)]:>15,.0f}" for b in BATCHES))
    print("the dense program alone (fp32; prepared inputs), p50 ms: " + ", ".join(
        f"{p} {dense[p]['1']['p50']:.3f} (1 row) / {dense[p]['1024']['p50']:.3f} (1024 rows)"
        for p in PROGRAMS))
    pre = result["preprocess"]
    print(f"raw TSV preprocessing (the data set's ingestion): {pre['rows_per_s']:,.0f} rows/s at "
          f"batch 1024; a one-line file p50 {pre['latency_ms']['p50']:.2f} ms, p99 "
          f"{pre['latency_ms']['p99']:.2f} ms")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
