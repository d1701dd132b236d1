"""Loader throughput: the parquet decode floor vs embedtrain's streaming loader vs a naive loader.

All in one process, alternating rounds so machine noise hits each alike; medians are reported.
- pyarrow_decode: ``pyarrow.parquet.read_table`` of the loader's columns (the decode floor);
- loader: ``ParquetBatchReader`` making KJT batches (batch 2048, shuffle on, DataConfig's default
  prefetch and shuffle buffer, 2 worker threads: what a GPU rank or one with spare cores runs);
  also with ``num_workers=0`` (synchronous: a CPU rank whose step takes every core) and 1 worker;
- naive: pandas rows (``itertuples``) into per-row Python lists, then one KJT per batch, on the
  first ``--naive-rows`` rows only (it is slow), decode and shuffle included.

Usage:
    python benchmarks/bench_loader.py --rows 2000000 --json benchmarks/out/loader.json \
        [--data /tmp/bench_ctr] [--rounds 3] [--naive-rows 50000] [--baseline /tmp/base]

With ``--baseline PATH`` (another checkout, e.g. ``git worktree add /tmp/base <commit>``) that
checkout's loader runs in the same process, in the same alternating rounds (its package copied
under the name ``embedtrain_baseline``): a before/after comparison one machine's noise cannot
skew, reported as ``baseline_loader_vs_decode`` and ``loader_vs_baseline``.

Without ``--data`` a data set of ``--rows`` rows is generated once under /tmp. With it, the data
set's files (train, valid, test) are used in order until they hold ``--rows`` rows. Prints a table
and writes JSON: ``rows_per_s``, ``ratios``, ``peak_rss_mb`` (peak resident memory of a fresh
process running one loader epoch, so the decode floor's whole-table reads do not count).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from embedtrain.runtime import tune_allocator

# as every embedtrain process, before torch's first allocation (EMBEDTRAIN_MALLOC=default: not)
tune_allocator()

import numpy as np
import pyarrow.parquet as pq
import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from embedtrain.config import DataConfig  # noqa: E402
from embedtrain.data.reader import ParquetBatchReader  # noqa: E402
from embedtrain.features import DenseTransform, FeatureSpec, load_dataset_meta  # noqa: E402

BATCH = 2048
LOADER_THREADS = 2  # data.num_workers: auto, where a loader thread has a core to itself


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, required=True, help="rows to read (data set size)")
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--data", help="a data set directory (default: generate one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--naive-rows", type=int, default=50_000)
    parser.add_argument("--baseline", help="another embedtrain checkout to measure alongside")
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    meta = load_dataset_meta(args.data or _generated(args.rows))
    files, rows = _files_for(meta, args.rows)
    spec, defaults = meta.features, DataConfig()
    if args.rss_child:  # one loader epoch in a fresh process: its peak RSS is the loader's own
        reader = ParquetBatchReader(files, spec, BATCH, shuffle=True,
                                    num_workers=LOADER_THREADS,
                                    shuffle_buffer_rows=defaults.shuffle_buffer_rows,
                                    prefetch_batches=defaults.prefetch_batches)
        before = _rss_mb("VmRSS:")
        for _ in reader:
            pass
        print(json.dumps({"before_mb": before, "peak_mb": _rss_mb("VmHWM:")}))
        return

    def loader(num_workers: int, reader_class=ParquetBatchReader) -> Callable[[int], float]:
        def run(epoch: int) -> float:
            reader = reader_class(
                files, spec, BATCH, shuffle=True, seed=0,
                shuffle_buffer_rows=defaults.shuffle_buffer_rows, num_workers=num_workers,
                prefetch_batches=defaults.prefetch_batches)
            start, n = time.perf_counter(), 0
            for batch in reader.iter_epoch(epoch):
                n += batch.labels.numel()
            assert n == rows, (n, rows)
            return n / (time.perf_counter() - start)
        return run

    def decode(_: int) -> float:
        start = time.perf_counter()
        n = sum(pq.read_table(f, columns=spec.columns).num_rows for f in files)
        return n / (time.perf_counter() - start)

    naive_table = _head(files, spec, args.naive_rows)

    def naive(epoch: int) -> float:
        return _naive_loader(naive_table, spec, epoch)

    runs = {
        "pyarrow_decode": decode,
        "loader": loader(LOADER_THREADS),
        "loader (num_workers=0)": loader(0),
        "loader (num_workers=1)": loader(1),
        "naive": naive,
    }
    if args.baseline:
        runs["loader (baseline)"] = loader(LOADER_THREADS, _baseline_reader(args.baseline))
    results: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            results[name].append(run(r))
    med = {name: statistics.median(values) for name, values in results.items()}
    child = subprocess.run([sys.executable, __file__, "--rss-child", "--rows", str(args.rows),
                            "--json", args.json, "--data", str(meta.root)],
                           capture_output=True, text=True, check=True)
    rss = json.loads(child.stdout.strip().splitlines()[-1])
    peak_rss_mb = rss["peak_mb"]

    print(f"{rows:,} rows in {len(files)} files; batch {BATCH}; {args.rounds} rounds; "
          f"torch threads {torch.get_num_threads()}; naive on {naive_table.num_rows:,} rows")
    print(f"{'':<26} {'median rows/s':>14} {'vs decode':>10}")
    for name, value in med.items():
        print(f"{name:<26} {value:>14,.0f} {value / med['pyarrow_decode']:>9.2f}x")
    ratios = {"loader_vs_decode": med["loader"] / med["pyarrow_decode"],
              "loader_vs_naive": med["loader"] / med["naive"],
              "threads_vs_sync": med["loader"] / med["loader (num_workers=0)"]}
    if args.baseline:
        ratios["baseline_loader_vs_decode"] = med["loader (baseline)"] / med["pyarrow_decode"]
        ratios["loader_vs_baseline"] = med["loader"] / med["loader (baseline)"]
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"loader alone (fresh process, one epoch): peak RSS {peak_rss_mb:,.0f} MB, "
          f"{rss['before_mb']:,.0f} MB before iterating (Python, torch, torchrec, metadata)")
    out = {
        "rows_per_s": {"pyarrow_decode": med["pyarrow_decode"], "loader": med["loader"],
                       "naive": med["naive"]},
        "ratios": ratios,
        "peak_rss_mb": peak_rss_mb,
        "extra": {
            "rows": rows, "files": [str(f) for f in files], "batch_size": BATCH,
            "rounds": args.rounds, "naive_rows": naive_table.num_rows,
            "loader_num_workers": LOADER_THREADS,
            "shuffle_buffer_rows": defaults.shuffle_buffer_rows,
            "rss_before_iterating_mb": rss["before_mb"], "medians": med, "all": results,
            "baseline": args.baseline,
        },
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


def _baseline_reader(checkout: str):
    """``ParquetBatchReader`` of another checkout, imported as package ``embedtrain_baseline``."""
    import importlib
    import re
    import shutil
    import tempfile

    source = Path(checkout) / "embedtrain"
    if not (source / "data" / "reader.py").is_file():
        raise SystemExit(f"--baseline {checkout}: not an embedtrain checkout")
    root = Path(tempfile.mkdtemp(prefix="embedtrain_baseline_"))
    shutil.copytree(source, root / "embedtrain_baseline")
    for path in (root / "embedtrain_baseline").rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bembedtrain\.", "embedtrain_baseline.", text))
    sys.path.insert(0, str(root))
    module = importlib.import_module("embedtrain_baseline.data.reader")
    features = importlib.import_module("embedtrain_baseline.features")

    def make(files, spec, *args, **kwargs):  # the baseline's own FeatureSpec type
        theirs = features.FeatureSpec(
            spec.label, spec.dense,
            tuple(features.SparseFeature(f.name, f.num_embeddings, f.multi_hot, f.max_length)
                  for f in spec.sparse),
            features.DenseTransform(spec.dense_transform.value), spec.num_classes,
            spec.max_labels)
        return module.ParquetBatchReader(files, theirs, *args, **kwargs)

    return make


def _generated(rows: int) -> Path:
    from embedtrain.datagen import CTRDataSpec, generate_ctr

    out = Path(f"/tmp/embedtrain_bench_loader_{rows}")
    if not (out / "metadata.json").is_file():
        generate_ctr(CTRDataSpec(rows=rows), out, progress=False)
    return out


def _files_for(meta, rows: int) -> tuple[list[Path], int]:
    files, total = [], 0
    for split in ("train", "valid", "test"):
        for f in meta.split_files.get(split, ()):
            if total >= rows:
                break
            files.append(f)
            total += pq.ParquetFile(f).metadata.num_rows
    if total < rows:
        raise SystemExit(f"{meta.root}: only {total:,} rows, --rows asks for {rows:,}")
    return files, total


def _head(files: list[Path], spec: FeatureSpec, rows: int):
    pf = pq.ParquetFile(files[0])
    groups, n = [], 0
    while n < rows and len(groups) < pf.metadata.num_row_groups:
        n += pf.metadata.row_group(len(groups)).num_rows
        groups.append(len(groups))
    return pf.read_row_groups(groups, columns=spec.columns).slice(0, rows)


def _naive_loader(table, spec: FeatureSpec, epoch: int) -> float:
    """The loop a first version would write: pandas rows -> Python lists -> tensors -> KJT."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    start = time.perf_counter()
    frame = table.to_pandas().sample(frac=1.0, random_state=epoch)  # decode + shuffle
    log = spec.dense_transform is DenseTransform.LOG1P
    names = spec.sparse_names
    n = 0
    for first in range(0, len(frame), BATCH):
        labels, dense = [], []
        ids: dict[str, list[int]] = {k: [] for k in names}
        lengths: dict[str, list[int]] = {k: [] for k in names}
        for row in frame.iloc[first : first + BATCH].itertuples(index=False):
            r = row._asdict()
            labels.append(float(r[spec.label]))
            dense.append([math.log1p(max(float(r[d]), 0.0)) if log else float(r[d])
                          for d in spec.dense])
            for k in names:
                v = r[k]
                items = list(v) if isinstance(v, (list, np.ndarray)) else [v]
                ids[k].extend(int(i) for i in items)
                lengths[k].append(len(items))
        KeyedJaggedTensor(
            keys=names,
            values=torch.tensor([i for k in names for i in ids[k]], dtype=torch.int64),
            lengths=torch.tensor([n_ for k in names for n_ in lengths[k]], dtype=torch.int32),
        )
        torch.tensor(dense, dtype=torch.float32), torch.tensor(labels)
        n += len(labels)
    return n / (time.perf_counter() - start)


def _rss_mb(field: str) -> float:
    """``VmRSS:`` (now) or ``VmHWM:`` (peak) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
