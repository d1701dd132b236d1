"""Node splits of a graph ingestion: random fractions, a split column, or id lists per split.

:func:`choose_node_splits` gives the train/valid/test node ids of ``split.method`` (see
:mod:`pipelines.graph.spec`) with every node in no split counted by reason, and refuses an empty
train split when the nodes have labels; :mod:`pipelines.graph.passes` calls it once the ids are
remapped. :class:`NodeTable` is the node table as the job read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.utils import first_line
from pipelines.core.errors import IngestError
from pipelines.core.fields import ValueType
from pipelines.graph.spec import NODE_SPLITS, GraphIngestSpec, GraphSplitSpec, SplitMethod

@dataclass
class NodeTable:
    """The node table as the job read it (ids in table order, features, labels, counts)."""

    ids: pl.Series
    features: Optional[np.ndarray]
    labels: Optional[np.ndarray]        # class ids, -1 unlabelled
    classes: list
    rows_read: int
    null_ids: int
    filled: dict[str, int]
    unlabelled: int
    split_values: Optional[pl.Series] = None  # split.method column: the column as text


def _node_splits(n: int, labels: Optional[np.ndarray], s: GraphSplitSpec
                 ) -> dict[str, np.ndarray]:
    pool = np.arange(n, dtype=np.int64) if labels is None else np.flatnonzero(labels >= 0)
    perm = pool[np.random.default_rng(np.random.SeedSequence([s.seed, 11])).permutation(
        pool.shape[0])]
    n_test, n_valid = round(s.test_fraction * pool.shape[0]), round(s.valid_fraction *
                                                                   pool.shape[0])
    return {"train": np.sort(perm[n_test + n_valid:]), "valid": np.sort(
        perm[n_test:n_test + n_valid]), "test": np.sort(perm[:n_test])}


@dataclass
class NodeSplitResult:
    """The node splits and how every node not in one is accounted for."""

    splits: dict[str, np.ndarray]   # train/valid/test node ids, sorted (empty ones included)
    in_no_split: dict[str, int]     # nodes in no split, by reason: splits + these = num_nodes
    extra: dict[str, Any]           # more report keys (per-file counts, unlisted values)
    warnings: list[str]


def choose_node_splits(spec: GraphIngestSpec, n: int, labels: Optional[np.ndarray],
                        table: Optional[NodeTable], ids: pl.DataFrame, node_files: list[Path]
                        ) -> NodeSplitResult:
    """The node splits of ``split.method``; refuses an empty train split when there are labels.

    User-chosen splits (column, ids) keep only labelled nodes when the graph has labels (an
    unlabelled node can be neither trained on nor scored), counted as ``unlabelled``.
    """
    s = spec.split
    extra: dict[str, Any] = {}
    if s.method is SplitMethod.RANDOM:
        splits = _node_splits(n, labels, s)
        in_no_split = {"unlabelled": 0 if labels is None else int((labels < 0).sum())}
    elif s.method is SplitMethod.COLUMN:
        assert table is not None and table.split_values is not None
        splits, in_no_split, extra = _column_splits(n, table, s)
    else:
        splits, in_no_split, extra = _id_list_splits(spec, n, ids)
    if s.method is not SplitMethod.RANDOM and labels is not None:
        unlabelled = 0
        for k, members in splits.items():
            keep = members[labels[members] >= 0]
            unlabelled += members.shape[0] - keep.shape[0]
            if "node_split_files" in extra and k in extra["node_split_files"]:
                extra["node_split_files"][k]["unlabelled"] = int(members.shape[0] - keep.shape[0])
            splits[k] = keep
        in_no_split["unlabelled"] = unlabelled
    assert sum(v.shape[0] for v in splits.values()) + sum(in_no_split.values()) == n
    warnings: list[str] = []
    if labels is not None:
        if splits["train"].shape[0] == 0:
            raise IngestError(_empty_train(spec, labels, table, node_files))
        empty = [k for k in ("valid", "test") if splits[k].shape[0] == 0]
        if empty:
            warnings.append(
                f"node split{'s' if len(empty) > 1 else ''} {' and '.join(empty)} "
                f"{'are' if len(empty) > 1 else 'is'} empty ({_why_empty(s, empty)}); written "
                "without them: training runs without validation, evaluation without those splits")
    return NodeSplitResult(splits, in_no_split, extra, warnings)


def _why_empty(s: GraphSplitSpec, empty: list[str]) -> str:
    if s.method is SplitMethod.RANDOM:
        return " and ".join(f"split.{k}_fraction: {getattr(s, f'{k}_fraction')}" for k in empty)
    if s.method is SplitMethod.COLUMN:
        values = s.split_values()
        return "; ".join(f"no labelled node has split.values.{k} {values[k]} in column {s.column}"
                         if values[k] else f"split.values.{k}: not given" for k in empty)
    return "; ".join(f"split.files.{k}: " + (f"no labelled node in {getattr(s.files, k)}"
                                            if getattr(s.files, k) else "not given")
                     for k in empty)


def _empty_train(spec: GraphIngestSpec, labels: np.ndarray, table: Optional[NodeTable],
                 node_files: list[Path]) -> str:
    s, label = spec.split, spec.nodes.label if spec.nodes else None
    if not (labels >= 0).any():
        return (f"{node_files[0] if node_files else 'nodes'}: column {label}: no node has a "
                "label; node classification needs labelled training nodes")
    if s.method is SplitMethod.RANDOM:
        pool = int((labels >= 0).sum())
        return (f"split.valid_fraction + split.test_fraction ({s.valid_fraction} + "
                f"{s.test_fraction}) leave no training nodes of the {pool} labelled; lower them")
    if s.method is SplitMethod.COLUMN:
        return (f"{node_files[0]}: column {s.column}: no labelled node has a split.values.train "
                f"value {s.split_values()['train']}; the training split is empty (set "
                "split.values.train to the column's training values)")
    if s.files.train is None:
        return ("split.files.train: not given; node classification needs a training id file "
                "(or the graph without nodes.label)")
    return f"{s.files.train}: no labelled node among its ids (split.files.train); train is empty"


def _column_splits(n: int, table: NodeTable, s: GraphSplitSpec
                   ) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, Any]]:
    values = table.split_values
    assert values is not None
    wanted = pl.DataFrame({"v": [v for vs in s.split_values().values() for v in vs],
                           "split": [k for k, vs in s.split_values().items() for _ in vs]},
                          schema={"v": pl.String, "split": pl.String})
    frame = (pl.DataFrame({"v": values}).with_row_index("node")
             .join(wanted, on="v", how="left", maintain_order="left"))
    node = frame["node"].cast(pl.Int64)
    splits = {k: np.sort(node.filter(frame["split"] == k).to_numpy().astype(np.int64))
              for k in NODE_SPLITS}
    unlisted = frame.filter(pl.col("split").is_null() & pl.col("v").is_not_null())
    top = (unlisted.group_by("v").agg(pl.len().alias("n")).sort(["n", "v"],
                                                                descending=[True, False])
           .head(20))
    in_no_split = {"not_in_node_table": n - values.len(), "null_value": int(values.null_count()),
                   "value_not_listed": unlisted.height}
    return splits, in_no_split, {"unlisted_values": dict(zip(top["v"].to_list(),
                                                             top["n"].to_list()))}


def id_files(s: GraphSplitSpec) -> dict[str, Path]:
    """``split.files``' id file of each split that has one."""
    return {k: Path(getattr(s.files, k)) for k in NODE_SPLITS if getattr(s.files, k)}


def _id_list_splits(spec: GraphIngestSpec, n: int, ids: pl.DataFrame
                    ) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, Any]]:
    """``method: ids``: each file's ids through the id remap; an unknown id is an error."""
    id_type = pl.Int64 if spec.id_type is ValueType.INTEGER else pl.String
    lookup = ids.select("id", "dense")
    splits = {k: np.zeros(0, dtype=np.int64) for k in NODE_SPLITS}
    files: dict[str, dict[str, Any]] = {}
    owner = np.full(n, -1, dtype=np.int8)
    for split, path in id_files(spec.split).items():
        values, where = _read_id_file(path, spec)
        frame = (pl.DataFrame({"id": values.cast(id_type)}).with_row_index("pos")
                 .join(lookup, on="id", how="left", maintain_order="left"))
        unknown = frame.filter(pl.col("dense").is_null())
        if unknown.height:
            raise IngestError(
                f"{path}: {where(int(unknown['pos'][0]))}: id {unknown['id'][0]!r} is not a node "
                f"of the graph ({unknown.height:,} of {frame.height:,} ids unknown; ids are "
                f"compared as {spec.id_type.value}s) (split.files.{split})")
        dense = frame["dense"].to_numpy().astype(np.int64)
        members = np.unique(dense)
        taken = owner[members] >= 0
        if taken.any():
            node = int(members[np.flatnonzero(taken)[0]])
            other = NODE_SPLITS[owner[node]]
            pos = int(np.flatnonzero(dense == node)[0])
            raise IngestError(f"{path}: {where(pos)}: id {frame['id'][pos]!r} is also in the "
                              f"{other} id file ({getattr(spec.split.files, other)}); a node "
                              "belongs to one split")
        owner[members] = NODE_SPLITS.index(split)
        splits[split] = members
        files[split] = {"file": str(path), "rows_read": frame.height,
                        "duplicates": frame.height - members.shape[0]}
    return splits, {"not_listed": int((owner < 0).sum())}, {"node_split_files": files}


def _read_id_file(path: Path, spec: GraphIngestSpec) -> tuple[pl.Series, Any]:
    """One id per row from a .npy array or a parquet/CSV column, and a position describer."""
    integer = spec.id_type is ValueType.INTEGER
    column = spec.split.id_column or (spec.nodes.id if spec.nodes is not None else "id")
    if path.suffix == ".npy":
        try:
            a = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise IngestError(f"{path}: not a readable .npy file: {first_line(e)}") from None
        if a.ndim != 1:
            raise IngestError(f"{path}: expected a 1-D array of node ids, got shape "
                              f"{list(a.shape)}")
        if a.dtype.kind in "iu":
            values = pl.Series(a.astype(np.int64))
        elif a.dtype.kind == "U" and not integer:
            values = pl.Series(a.tolist(), dtype=pl.String)
        else:
            want = "integer" if integer else "integer or string"
            raise IngestError(f"{path}: expected {want} node ids, got dtype {a.dtype}")
        return (values.cast(pl.String) if not integer else values), (
            lambda i: f"position {i}")
    if path.suffix == ".parquet":
        try:
            schema = {f.name: f.type for f in pq.read_schema(path)}
        except (pa.ArrowException, OSError) as e:
            raise IngestError(f"{path}: not a readable parquet file: {first_line(e)}") from None
        if column not in schema:
            raise IngestError(f"{path}: missing column {column} (split.id_column; has: "
                              f"{', '.join(list(schema)[:20])})")
        if integer:
            check_parquet_type(path, column, schema[column], "integer")
        values = pl.read_parquet(path, columns=[column])[column]
        where = lambda i: f"row {i}"  # noqa: E731
    else:
        separator = "\t" if path.suffix == ".tsv" else ","
        if path.stat().st_size == 0:
            raise IngestError(f"{path}: empty file (no CSV header)")
        try:
            frame = pl.read_csv(path, separator=separator, infer_schema=False)
        except pl.exceptions.PolarsError as e:
            raise IngestError(f"{path}: cannot read: {first_line(e)}") from None
        if column not in frame.columns:
            raise IngestError(f"{path}: missing column {column} (split.id_column; has: "
                              f"{', '.join(frame.columns[:20])})")
        values = frame[column]
        where = lambda i: f"line {i + 2}"  # noqa: E731
        if integer:
            parsed = values.cast(pl.Int64, strict=False)
            bad = np.flatnonzero((parsed.is_null() & values.is_not_null()).to_numpy())
            if bad.shape[0]:
                raise IngestError(f"{path}: {where(int(bad[0]))}: column {column}: cannot parse "
                                  f"as an integer id (id_type: integer) (value "
                                  f"{values[int(bad[0])]!r})")
            values = parsed
    nulls = np.flatnonzero(values.is_null().to_numpy())
    if nulls.shape[0]:
        raise IngestError(f"{path}: {where(int(nulls[0]))}: column {column}: missing id")
    return (values.cast(pl.String) if not integer else values.cast(pl.Int64)), where


def check_parquet_type(path: Path, column: str, arrow_type: Any, want: str) -> None:
    """One line naming the file and column when a parquet column is not of the type ``want``."""
    ok = {"integer": pa.types.is_integer, "number": lambda t: pa.types.is_integer(t) or
          pa.types.is_floating(t),
          "time": lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or
          pa.types.is_temporal(t)}[want](arrow_type)
    if not ok:
        raise IngestError(f"{path}: column {column}: expected {want} values, got {arrow_type}")
