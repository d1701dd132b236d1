"""``embedtrain export`` and ``embedtrain predict``: a run's checkpoint as files for inference, and
streaming scores of parquet rows with such an export (``embedtrain.export``)."""

from __future__ import annotations

import argparse
import sys

from embedtrain.cli.errors import UsageError
from embedtrain.utils import Stopped


def register(sub) -> None:
    """Adds the ``export`` and ``predict`` commands to the subparsers ``sub``."""
    p = sub.add_parser("export", help="a run's checkpoint as files for inference: embedding "
                       "tables, the dense model (torch.export), model.json")
    p.add_argument("run_dir", nargs="?", help="a run directory written by `embedtrain train`")
    p.add_argument("--checkpoint", help="step (e.g. 500) or checkpoint directory (default: the "
                   "step the run's summary.json reports, e.g. its best with train.select: best; "
                   "an unfinished run's newest)")
    p.add_argument("--out", help="export directory (with --delta-from: the delta's)")
    p.add_argument("--delta-from", metavar="EXPORT", help="write only what changed since EXPORT "
                   "(an export of an earlier run of the line): changed table rows, id map "
                   "changes, the files that differ (embedtrain.export.delta)")
    p.add_argument("--apply", metavar="DELTA", help="patch the export --to with DELTA in place, "
                   "atomically (no RUN_DIR)")
    p.add_argument("--to", metavar="EXPORT", help="with --apply: the served export to patch")
    p.add_argument("--quantize", default="none", help="tables as none (float32), int8 or int4 "
                   "(TorchRec/FBGEMM rowwise quantization; default: none)")
    p.add_argument("--format", default="npy", help="table files: npy, parquet or npy,parquet "
                   "(default: npy)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--aot", action="store_true", help="also compile the dense program with "
                   "AOTInductor (dense.aoti.pt2; needs a C++ compiler, tens of seconds)")
    p.add_argument("--index", help="retrieval: the item index: auto (exact flat up to 200,000 "
                   "items, hnsw above; the default), flat, hnsw or ivf (FAISS; the recall of an "
                   "approximate one against exact search is measured and written to model.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_export)

    p = sub.add_parser("add-items", help="retrieval: add items to an export without "
                       "retraining (embedded by its item tower, added to its index)")
    p.add_argument("export_dir", help="a retrieval export (embedtrain export)")
    p.add_argument("--items", required=True, help="parquet file of the new items: the item "
                   "table's feature columns (and optionally item, numbering on from the "
                   "export's items)")
    p.set_defaults(func=_add_items)

    p = sub.add_parser("predict", help="score rows with an export (streaming): parquet rows in "
                       "the data set's layout, or raw rows (--raw); GNN exports: node ids "
                       "(column node, or id: the data set's original ids), parquet or CSV")
    p.add_argument("export_dir", help="a directory written by `embedtrain export`")
    p.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH_OR_GLOB",
                   help="parquet file, directory or quoted glob in the data set's layout; with "
                        "--raw, raw files as the data set was ingested from; GNN: parquet or "
                        "CSV files with a node (or id) column (repeatable)")
    p.add_argument("--raw", action="store_true", help="the inputs are raw rows (Criteo TSV, "
                   "CSV, parquet, XC repository format): encoded by the data set's own "
                   "ingestion (its spec, vocabularies, statistics, copied into the export)")
    p.add_argument("--keep", action="append", default=[], metavar="COLUMN",
                   help="an input column to copy to the output, e.g. a request id "
                        "(repeatable)")
    p.add_argument("--on-invalid", choices=("drop", "error"), default="drop",
                   help="--raw: rows ingestion would drop are skipped and counted by reason, "
                        "listed in <out>.invalid.parquet (drop, the default), or stop the "
                        "command at the first (error)")
    p.add_argument("--program", choices=("export", "aot"), default="export",
                   help="the dense program: the torch.export program (default) or the "
                        "AOTInductor package (`embedtrain export --aot`)")
    p.add_argument("--out", required=True, help="predictions parquet file")
    p.add_argument("--batch-size", type=int, default=8192, help="rows scored at once "
                   "(default: 8192)")
    p.add_argument("--top-k", type=int, help="XC: classes per row (default: the run's largest "
                   "head.top_k)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_predict)


def _stopped(command: str, e: Stopped) -> int:
    """A SIGTERM or SIGINT that stopped a write (its partial output removed): one line, and
    the shell's status for a process the signal ended (128 + its number)."""
    print(f"embedtrain {command}: {e}", file=sys.stderr)
    return 128 + e.signum


def _export(args: argparse.Namespace) -> int:
    from embedtrain.export.export import export_run

    if args.apply is not None or args.delta_from is not None:
        return _delta(args)
    if args.run_dir is None or args.out is None:
        raise UsageError("export: give RUN_DIR and --out (or --apply DELTA --to EXPORT)")
    try:
        result = export_run(args.run_dir, args.out, checkpoint=args.checkpoint,
                            quantize=args.quantize, formats=args.format.split(","),
                            overwrite=args.overwrite, progress=not args.no_progress,
                            aot=args.aot, index=args.index)
    except Stopped as e:
        return _stopped("export", e)
    m, mib = result.manifest, 2**20
    print(f"exported step {m.source.step:,} of {args.run_dir} ({m.source.world_size} rank(s), "
          f"{m.task}) to {result.out} in {result.seconds:.1f} s")
    print(f"  checkpoint   step {m.source.step:,}: {result.chosen}")
    rows = sum(t.rows for t in m.tables)
    sizes = f"{m.float32_bytes / mib:,.1f} MiB float32"
    if m.quantize != "none":
        sizes += (f" -> {m.table_bytes / mib:,.1f} MiB {m.quantize} "
                  f"({m.float32_bytes / max(m.table_bytes, 1):.2f}x smaller)")
    print(f"  tables       {len(m.tables)}, {rows:,} rows, {sizes}")
    dynamic = [t for t in m.tables if t.dynamic]
    if dynamic:
        held = sum(t.ids_held or 0 for t in dynamic)
        print(f"  id maps      {len(dynamic)} dynamic table(s): {held:,} ids -> rows "
              f"(tables/<table>.ids.parquet; other ids take their shard's default row)")
    if m.items is not None:
        i = m.items
        recall = (f"recall@10 vs exact {i.recall_at_10_vs_exact:.3f} on {i.recall_queries:,} "
                  f"queries, " if i.index != "flat" else "exact, ")
        params = ", ".join(f"{k} {v}" for k, v in i.params.items())
        print(f"  items        {i.num_items:,} x {m.head.dim} ({m.head.files.npy}); index "
              f"{i.index}{f' ({params})' if params else ''}: {recall}built in {i.build_s:.1f} s")
    elif m.head is not None:
        print(f"  class head   {m.head.num_classes:,} x {m.head.dim} ({m.head.kind}), "
              f"{m.head.bytes / mib:,.1f} MiB {m.head.dtype}, {len(m.head.shards)} shard(s)")
    if m.dense_program is not None:
        print(f"  dense model  {m.dense_program.file} ({m.dense_program.format}), "
              f"{m.dense_program.parameters:,} parameters")
        if m.dense_program.aot:
            size = (result.out / m.dense_program.aot).stat().st_size
            print(f"  AOT package  {m.dense_program.aot} (AOTInductor, {size / mib:,.1f} MiB: "
                  f"embedtrain predict --program aot, examples/serve_aot.py)")
    else:
        print(f"  dense model  none ({m.note})")
    if m.nodes is not None:
        arrays = ", ".join(f"{a.name} [{a.rows:,}, {a.dim}]" for a in m.nodes.arrays)
        print(f"  node outputs {arrays} (layer-wise full-graph inference; embedtrain predict "
              f"looks them up by node id)")
    if result.peak_over_baseline is not None:
        print(f"  memory       peak RSS {result.peak_over_baseline / mib:,.1f} MiB over the "
              f"{result.baseline_rss / mib:,.0f} MiB before the tables (largest table "
              f"{result.largest_table / mib:,.1f} MiB)")
    print(f"files: {result.out}/ (model.json, tables/, {'nodes/, ' if m.nodes else ''}"
          f"{m.dense_program.file + ', ' if m.dense_program else ''}"
          f"{m.dense_program.aot + ', ' if m.dense_program and m.dense_program.aot else ''}"
          f"config.yaml)")
    return 0


def _delta(args: argparse.Namespace) -> int:
    from embedtrain.export.delta import apply_delta, export_delta

    if args.apply is not None:
        if args.to is None or args.run_dir is not None or args.delta_from is not None:
            raise UsageError("--apply DELTA: give --to EXPORT, and no RUN_DIR or --delta-from")
        r = apply_delta(args.apply, args.to)
        print(f"applied {args.apply} to {args.to}: {r['rows_changed']:,} table rows, "
              f"{sum(e['upserted'] + e['removed'] for e in r['id_maps']):,} id map entries, "
              f"{len(r['files'])} file(s) replaced")
        return 0
    if args.run_dir is None or args.out is None:
        raise UsageError("--delta-from EXPORT: give RUN_DIR and --out DELTA")
    if args.quantize != "none" or args.format != "npy" or args.aot or args.index:
        raise UsageError("--delta-from: the delta takes the base export's --quantize, "
                         "--format, --aot and --index")
    try:
        r = export_delta(args.run_dir, args.delta_from, args.out, args.checkpoint,
                         progress=not args.no_progress)
    except Stopped as e:
        return _stopped("export", e)
    print(f"delta of {args.run_dir} against {args.delta_from} in {args.out}: "
          f"{r['bytes'] / 2**20:,.2f} MiB, {r['bytes_fraction_of_full']:.1%} of the full export; "
          f"{r['rows_changed']:,} of {r['table_rows']:,} table rows changed "
          f"({r['rows_changed_fraction']:.1%}); apply: embedtrain export --apply {args.out} "
          f"--to EXPORT")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from embedtrain.export.predict import predict

    try:
        result = predict(args.export_dir, args.inputs, args.out, batch_size=args.batch_size,
                         top_k=args.top_k, progress=not args.no_progress, raw=args.raw,
                         keep=args.keep, on_invalid=args.on_invalid, program=args.program)
    except Stopped as e:
        return _stopped("predict", e)
    rate = result.rows / max(result.seconds, 1e-9)
    print(f"scored {result.rows:,} rows from {result.files} file(s) in {result.seconds:.1f} s "
          f"({rate:,.0f} rows/s)")
    if result.invalid:
        reasons = ", ".join(f"{k} {n:,}" for k, n in sorted(result.invalid.items()))
        print(f"  not scored   {sum(result.invalid.values()):,} invalid row(s): {reasons} "
              f"(listed in {result.invalid_file})")
    for k, v in result.metrics.items():
        print(f"  {k:<12} {v:.6f}" if isinstance(v, float) else f"  {k:<12} {v:,}")
    print(f"written: {result.out}")
    return 0


def _add_items(args: argparse.Namespace) -> int:
    from embedtrain.export.items import add_items

    before = add_items(args.export_dir, args.items)
    print(f"added items to {args.export_dir}: now {before.num_items:,} items ("
          f"{before.added_items:,} added since export), index {before.index}")
    return 0
