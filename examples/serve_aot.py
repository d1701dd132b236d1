"""Scoring CTR rows with an export and nothing of embedtrain: torch, fbgemm_gpu and numpy only.

What it shows: an ``embedtrain export RUN --out DIR --aot`` directory is all a serving process
needs. ``model.json`` (plain JSON) names the rows' columns, each table's file, dtype and pooling,
and the dense program; the tables are ``.npy`` arrays, memory-mapped, one row per id (float32
rows, or FBGEMM's fused int8/int4 rows: codes, then fp16 scale and fp16 bias, which
``torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat`` dequantizes as TorchRec's quantized
tables do); ``dense.aoti.pt2`` is the dense model compiled by AOTInductor (C++ kernels and
weights), run by ``torch._inductor.aoti_load_package`` without the model's Python code. The
steps are those of ``embedtrain predict``: each dense column through its ``transform``, each
sparse feature's ids pooled by its table (``embedding_bag``), the pooled embeddings stacked
``[B, tables, D]`` in the manifest's table order, the package's logits, ``sigmoid`` for scores.

Scope: CTR exports (DLRM, DCNv2, a recipe whose dense program takes ``(dense, pooled)``) without
first-order tables (DeepFM, ``model.linear``) and without dynamic tables (``id_map``: raw ids
mapped to rows); rows in the data set's layout (dense number columns, int64 or list<int64> id
columns, e.g. a split's files). Anything else is refused in one line (exit status 2).

Usage:
    embedtrain export runs/demo --out exports/demo --aot
    python examples/serve_aot.py exports/demo data/synthetic_ctr/test --rows 1000 --out scores.npy

``--out`` saves float32 ``[rows, 2]``: the logit, then the score (click probability).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch._inductor
import torch.nn.functional as F

BITS = {"int8": 8, "int4": 4}


def fail(message: str) -> None:
    print(f"serve_aot: error: {message}", file=sys.stderr)
    sys.exit(2)


def load(export: Path) -> dict:
    """``model.json``, refused unless this script covers it."""
    try:
        m = json.loads((export / "model.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{export / 'model.json'}: not an export: {e}")
    program = m.get("dense_program") or {}
    if m["task"] != "ctr":
        fail(f"{export}: a {m['task']} export; this example scores CTR exports")
    if not program.get("aot"):
        fail(f"{export}: no AOTInductor package; export with --aot")
    if any(t.get("id_map") for t in m["tables"]):
        fail(f"{export}: dynamic tables (id maps) are not covered; use embedtrain predict")
    if len(m["tables"]) != len(m["features"]["sparse"]):
        fail(f"{export}: first-order tables are not covered; use embedtrain predict")
    return m


def dense_block(rows, features: list[dict]) -> torch.Tensor:
    """``[B, n_dense]`` float32, each column through its transform as training's reader does
    (``log1p``: ``log(1 + max(x, 0))``, integer counts in float64)."""
    columns = []
    for f in features:
        x = rows.column(f["name"]).to_numpy()
        if f["transform"] == "log1p":
            x = np.log1p(np.maximum(x if x.dtype.kind in "iu" else x.astype(np.float32), 0))
        columns.append(x.astype(np.float32))
    return torch.from_numpy(np.stack(columns, axis=1))


def pooled(rows, table: dict, feature: str, array: np.ndarray) -> torch.Tensor:
    """``[B, dim]``: each row's ids of ``feature`` looked up in ``table`` and pooled."""
    column = rows.column(feature).combine_chunks()
    if column.null_count:
        fail(f"column {feature}: null values")
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):  # bags of ids
        ids = column.flatten().to_numpy()
        lengths = pc.list_value_length(column).to_numpy()
    else:  # one id per row
        ids, lengths = column.to_numpy(), np.ones(len(column), np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= table["rows"]):
        fail(f"column {feature}: ids outside [0, {table['rows']}) (table {table['name']})")
    looked_up = torch.from_numpy(np.ascontiguousarray(array[ids]))  # only these rows are read
    if table["dtype"] in BITS:  # fused rows -> float32, as TorchRec's quantized tables read them
        looked_up = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(
            looked_up, BITS[table["dtype"]])
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
    return F.embedding_bag(torch.arange(len(ids)), looked_up.reshape(len(ids), table["dim"]),
                           offsets, mode=table["pooling"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="an `embedtrain export --aot` directory")
    parser.add_argument("rows", help="parquet file (or directory) in the data set's layout")
    parser.add_argument("--rows", dest="n", type=int, help="score the first N rows only")
    parser.add_argument("--out", help="save [rows, 2] float32 (logit, score) to this .npy")
    args = parser.parse_args()
    m = load(args.export)
    features = m["features"]
    rows = pq.read_table(args.rows, columns=[f["name"] for f in features["dense"]]
                         + [f["name"] for f in features["sparse"]])
    rows = rows.slice(0, args.n) if args.n else rows
    if not rows.num_rows:
        fail(f"{args.rows}: no rows to score")

    dense = dense_block(rows, features["dense"])
    embeddings = []
    for t in m["tables"]:  # the program takes the tables' pooled embeddings in this order
        array = np.load(args.export / t["files"]["npy"], mmap_mode="r")
        embeddings += [pooled(rows, t, f, array) for f in t["features"]]
    package = torch._inductor.aoti_load_package(str(args.export / m["dense_program"]["aot"]))
    with torch.no_grad():  # the package's kernels take contiguous inputs
        logits = package(dense.contiguous(), torch.stack(embeddings, dim=1).contiguous())
    scores = torch.sigmoid(logits)

    print(f"scored {rows.num_rows:,} rows with {args.export} ({m['model']}, {m['quantize']} "
          f"tables, {m['dense_program']['aot']})")
    for i in range(min(5, rows.num_rows)):
        print(f"  row {i}: logit {logits[i]:+.4f}  score {scores[i]:.4f}")
    if args.out:
        np.save(args.out, torch.stack([logits, scores], dim=1).numpy())
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
