"""``embedtrain predict``: scores parquet rows with an export, batch by batch.

:class:`ExportedModel` loads an export directory (:mod:`embedtrain.export.manifest`): its tables
into TorchRec's ``EmbeddingBagCollection`` (float32 ``.npy`` files memory-mapped) or, for
``int8``/``int4`` exports, into TorchRec's quantized inference ``EmbeddingBagCollection``
(FBGEMM's n-bit kernels); the dense program with ``torch.export.load`` (``program="aot"``: its
AOTInductor package ``dense.aoti.pt2``, ``torch._inductor.aoti_load_package``); an XC class head
scored in blocks of classes (:func:`embedtrain.heads.topk.blocked_topk`, the kernel evaluation
uses), its ``.npy`` memory-mapped, never copied whole: float32, or bfloat16 bits viewed as
``torch.bfloat16``; each block is widened to the features' dtype and, when ``normalised``,
L2-normalised as it is scored, as evaluation does; a dynamic table's id -> row map
(``tables/<table>.ids.parquet``, :mod:`embedtrain.export.manifest`) as sorted int64 tensors.

Dynamic tables take the data's ids (raw int64 ids, ``encoding: raw``), not rows: before the
lookup, :meth:`ExportedModel.rows` maps each batch's ids of such a feature exactly as training's
evaluation does -- a binary search in the map (``torch.searchsorted``); an id found gets its
row, any other id the default row of the shard its mixed id falls in
(:func:`embedtrain.tables.dynamic.checkpoint_default_rows` of
:func:`~embedtrain.tables.dynamic.mix_ids`), so a run trained on N ranks scores the same
unseen ids as its evaluation did. Static tables look ids up as rows, unchanged.

:func:`predict` streams the input files (parquet rows in the data set's layout, e.g. its split
files): one ``--batch-size`` of rows is read, checked (types, nulls, ids in range; the file,
column and row of a bad value named; ids of a dynamic table's feature lie in ``[0, 2^63 - 1)``,
of a static one in ``[0, num_embeddings)``), turned into a TorchRec batch exactly as training's
reader does (same dense transform), scored and appended to the output parquet; memory is bounded
by a batch and a row group, never the input (but for the AUC of labelled click rows: exact, it
ranks every score, kept as float32: 4 bytes a labelled row). Output columns, one row per input
row, in input order:

* no class head (CTR): ``logit`` and ``score`` (the click probability, ``sigmoid(logit)``),
  float32;
* a class head (XC): ``top_ids`` (``list<int64>``, class ids, best first) and ``top_scores``
  (``list<float32>``, the head's logits), ``--top-k`` of them (default: the largest of the
  head's ``top_k``, the run's ``head.top_k``);

plus the input's label column (``label`` or ``labels``) where the input has it; then the
metrics of the scores against it are returned too (AUC and log loss; with a head: P@1,
and HR@k where every row has one label).

What scoring takes is in ``model.json`` (its ``head``) but for one thing, which the run's recipe
says (the export's copy of ``config.yaml``): how the dense program takes the pooled embeddings
(:meth:`~embedtrain.recipes.base.Recipe.predict_pooled`: stacked for DLRM, concatenated for
XC). A GNN export has no dense program: its per-node outputs, computed at export, are looked up
by node id (:func:`embedtrain.export.nodes.predict_nodes`, which :func:`predict` hands such an
export to).

Example:
    >>> model = ExportedModel("exports/demo")
    >>> result = predict("exports/demo", ["data/synthetic_ctr/test/*.parquet"], "preds.parquet")
    >>> result.rows, result.metrics["auc"]
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedtrain.config import load_run_config
from embedtrain.config_io import ConfigError
from embedtrain.export.manifest import ExportError, load_manifest
from embedtrain.export.programs import load_program
from embedtrain.export.rows import (
    ParquetRows,
    PredictResult,
    RawRows,
    check_rows,
    describe_invalid,
    input_files,
    model_batch,
    parquet_output,
    write_invalid,
)
from embedtrain.export.tables import (
    NPY_DTYPES,
    TORCH_DTYPES,
    float_collection,
    quantized_collection,
    quantized_width,
    read_id_map,
    read_table,
)
from embedtrain.features import DenseTransform, FeatureSpec, SparseFeature
from embedtrain.tables.dynamic import (
    EMPTY_ID,
    MIX_VERSION,
    checkpoint_default_rows,
    mix_ids,
    unmix_ids,
)
from embedtrain.models.seq import first_k_outside
from embedtrain.recipes import family_recipe
from embedtrain.recipes.base import quiet_fx_tracing_warning
from embedtrain.utils import check_output_file, progress_bar

_HEAD_BLOCK = 65_536  # classes scored at once (as evaluation does)
# mix_ids maps the one id whose image is EMPTY_ID onto EMPTY_ID - 1, another id's image: in
# training both share a row, which the map records under the other id
_MIXED_TO_EMPTY = int(unmix_ids(torch.tensor([EMPTY_ID]))[0])
_SHARES_ITS_ROW = int(unmix_ids(torch.tensor([EMPTY_ID - 1]))[0])


class IdMap:
    """A dynamic table's id -> row map (its export's ``ids.parquet`` and default rows).

    Args:
        ids: the raw ids that own a row, int64, strictly ascending.
        rows: their rows, int64.
        segments: the run's row-wise shard starts, then the table's rows.
    """

    def __init__(self, ids: Tensor, rows: Tensor, segments: Sequence[int]) -> None:
        self.ids, self.held = ids, rows
        self.segments = torch.tensor(list(segments), dtype=torch.int64)

    def __len__(self) -> int:
        return self.ids.numel()

    def rows(self, ids: Tensor) -> Tensor:
        """The rows raw ``ids`` (int64, in ``[0, 2^63 - 1)``) look up: their own where they
        hold one, else the default row of their shard (as training's evaluation remaps them)."""
        ids = torch.where(ids == _MIXED_TO_EMPTY, _SHARES_ITS_ROW, ids)
        default = checkpoint_default_rows(mix_ids(ids), self.segments)
        if not len(self):
            return default
        at = torch.searchsorted(self.ids, ids).clamp_(max=len(self) - 1)
        return torch.where(self.ids[at] == ids, self.held[at], default)


def _manifest_stamp(root: Path) -> Optional[tuple[int, int, int]]:
    try:
        st = (root / "model.json").stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class ExportedModel:
    """An export directory loaded for scoring (an export with a dense program: CTR, XC).

    Args:
        root: the export directory.
        program: the dense program to score with: ``export`` (``dense.pt2``, or its TorchScript
            fallback) or ``aot`` (its AOTInductor package, ``dense.aoti.pt2``: ``--aot``).

    Raises:
        ExportError: no usable ``model.json`` or ``config.yaml``, an export without a dense
            program (GNN) or without the ``aot`` package asked for, or a missing/mismatched
            file (named).
    """

    def __init__(self, root: str | os.PathLike, program: str = "export") -> None:
        for _ in range(3):  # a delta applied while it loaded (embedtrain.export.delta): again
            before = _manifest_stamp(Path(root))
            self._load(Path(root), program)
            if _manifest_stamp(Path(root)) == before:
                return
        raise ExportError(f"{root}: changed while it was loaded, three times; load it again")

    def _load(self, root: Path, program: str) -> None:
        self.root = root
        m = self.manifest = load_manifest(self.root)
        where = self.root / "model.json"
        if m.dense_program is None:
            what = ("its per-node outputs are read by embedtrain.export.nodes.ExportedNodes"
                    if m.nodes is not None else m.note or "this one has no dense program")
            raise ExportError(f"{where}: task {m.task}: ExportedModel scores rows with ctr and "
                              f"xc exports ({what})")
        try:
            # the built-in recipe of the run's task: an export never makes predict import code
            self.recipe = family_recipe(load_run_config(self.root / m.source.config), m.task)
        except ConfigError as e:
            raise ExportError(str(e)) from None
        f = m.features
        transform = f.dense[0].transform if f.dense else "none"
        self.spec = FeatureSpec(
            label=f.label, dense=tuple(d.name for d in f.dense),
            sparse=tuple(SparseFeature(s.name, s.num_embeddings, s.multi_hot, s.max_length,
                                       raw=s.encoding == "raw")
                         for s in f.sparse),
            dense_transform=DenseTransform(transform), num_classes=f.num_classes,
            max_labels=f.max_labels)
        quantized = m.quantize != "none"
        # the tables a row's features look up (a retrieval export's item tables are the item
        # side's, already applied in items/embeddings.npy)
        names = {x.name for x in f.sparse}
        tables = [t for t in m.tables if set(t.features) <= names]
        arrays = []
        for t in tables:
            if quantized:
                arrays.append(read_table(self.root, t.files.npy, None,
                                         (t.rows, quantized_width(t.dim, m.quantize)), np.uint8))
            else:
                arrays.append(read_table(self.root, t.files.npy, t.files.parquet,
                                         (t.rows, t.dim), np.float32))
        # A feature may feed two tables (its embedding and its first-order weight): each
        # collection holds at most one table per feature, the n-th table of a feature in the n-th
        # (a TorchRec collection's outputs are keyed by feature)
        groups: list[list[int]] = []
        # (and a table looked up per position, pooling none, only with others of its kind)
        for i, t in enumerate(tables):
            g = next((g for g in groups if not set(t.features) & {
                f for j in g for f in tables[j].features}
                and (tables[g[0]].pooling == "none") == (t.pooling == "none")), None)
            if g is None:
                groups.append(g := [])
            g.append(i)
        self.collections = nn.ModuleList(
            quantized_collection([tables[i] for i in g], [arrays[i] for i in g], m.quantize)
            if quantized else float_collection([tables[i] for i in g], [arrays[i] for i in g])
            for g in groups)
        # (collection, feature) of each table's pooled embeddings, in the manifest's order
        self.feature_order = sorted(
            ((k, i, f) for k, g in enumerate(groups) for i in g for f in tables[i].features),
            key=lambda x: x[1])
        # dynamic tables: feature -> its table's id map
        self.id_maps: dict[str, IdMap] = {}
        for t in tables:
            if t.id_map is None:
                continue
            if t.id_mix != MIX_VERSION:
                raise ExportError(f"{where}: tables: {t.name}: id_mix {t.id_mix!r}, this "
                                  f"embedtrain maps ids with {MIX_VERSION!r}; predict with the "
                                  f"version that exported it")
            if not t.segments or t.segments[-1] != t.rows:
                raise ExportError(f"{where}: tables: {t.name}: segments {t.segments} do not end "
                                  f"at its {t.rows} rows")
            try:
                ids, rows = read_id_map(self.root / t.id_map, t.rows)
            except ValueError as e:
                raise ExportError(str(e)) from None
            for name in t.features:
                self.id_maps[name] = IdMap(ids, rows, t.segments)
        d = m.dense_program
        if program not in ("export", "aot"):
            raise ExportError(f"program: {program!r} is not export or aot")
        if program == "aot" and d.aot is None:
            raise ExportError(f"{where}: no AOTInductor package; export with --aot")
        self.program = load_program(self.root / (d.aot if program == "aot" else d.file),
                                     "aot" if program == "aot" else d.format)
        self.head_weight: Optional[Tensor] = None
        if m.head is not None:
            self.head_weight = _head_weight(self.root, m.head, where)
        self.index = None  # retrieval: an approximate index searches the items
        if m.items is not None and m.items.index != "flat":
            from embedtrain.export.items import read_index

            self.index = read_index(self.root, m.items)

    @property
    def table_memory_bytes(self) -> int:
        """Bytes of the tables as the lookup modules hold them: the float32 weights, or the
        rows (codes, scale and bias, aligned) of the quantized module's FBGEMM kernels."""
        if self.manifest.quantize == "none":
            return sum(p.numel() * p.element_size() for p in self.collections.parameters())
        return sum(m.weights_host.numel() * m.weights_host.element_size()
                   for c in self.collections for m in c._emb_modules)  # rows per kernel

    @torch.no_grad()
    def rows(self, sparse):
        """The ``KeyedJaggedTensor`` of the data's ids as the tables' rows: the ids of dynamic
        tables' features mapped through their id maps (:meth:`IdMap.rows`), the others as
        they are (a static table's id is its row)."""
        if not self.id_maps:
            return sparse
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        values = sparse.values().clone()
        offsets = sparse.offset_per_key()
        for i, key in enumerate(sparse.keys()):
            if key in self.id_maps and offsets[i + 1] > offsets[i]:
                span = slice(offsets[i], offsets[i + 1])
                values[span] = self.id_maps[key].rows(values[span])
        return KeyedJaggedTensor(keys=sparse.keys(), values=values, lengths=sparse.lengths(),
                                 stride=sparse.stride(), length_per_key=sparse.length_per_key(),
                                 offset_per_key=offsets)

    @torch.no_grad()
    def pooled(self, sparse) -> list[Tensor]:
        """The tables' pooled embeddings of a ``KeyedJaggedTensor`` of the data's ids (raw ids
        for dynamic tables, mapped by :meth:`rows`), ``[B, dim]`` per feature, in the manifest's
        table order (the model's feature order, which the dense program takes)."""
        rows = self.rows(sparse)
        by_key = [c(rows) for c in self.collections]  # an EmbeddingCollection's: a dict
        by_key = [out if isinstance(out, dict) else out.to_dict() for out in by_key]
        return [by_key[k][name] for k, _, name in self.feature_order]

    @torch.no_grad()
    def outputs(self, dense: Tensor, sparse) -> Tensor:
        """The dense program's output: click logits ``[B]`` (no head), or the features ``[B, D]``
        the class head scores. The pooled embeddings take the program's layout from the run's
        recipe (:meth:`~embedtrain.recipes.base.Recipe.predict_pooled`)."""
        pooled = self.recipe.predict_pooled(self.pooled(sparse))
        return self.program(dense, *(pooled if isinstance(pooled, tuple) else (pooled,)))

    @torch.no_grad()
    def topk(self, dense: Tensor, sparse, k: int) -> tuple[Tensor, Tensor]:
        """With a class head: ``(scores [B, k], class ids [B, k])`` over all classes, best first
        (ties: the lower class id; fewer than ``k`` classes: padded with ``-inf`` and ``-1``)."""
        from embedtrain.heads.topk import blocked_topk

        x = self.outputs(dense, sparse)
        excluded = self.recipe.predict_excluded(sparse)
        n = k + (0 if excluded is None else excluded.shape[1])
        if self.index is not None:
            from embedtrain.export.items import search

            top = search(self.index, x, n)
            return top if excluded is None else first_k_outside(*top, excluded, k)
        h = self.manifest.head
        if h.normalised:
            x = F.normalize(x, dim=1) * h.scale
        # the head's rows are widened and normalised one block at a time (no copy of the head)
        top = blocked_topk(x, self.head_weight, n, _HEAD_BLOCK, normalize_rows=h.normalised)
        return top if excluded is None else first_k_outside(*top, excluded, k)


def _head_weight(root: Path, h, where: Path) -> Tensor:
    """The class head as stored: float32, or the bfloat16 (float8) bits of its ``.npy`` viewed
    as ``torch.bfloat16`` (``torch.float8_e4m3fn``; memory-mapped, not copied; a float32 head's
    parquet is read whole)."""
    shape = (h.num_classes, h.dim)
    if h.dtype == "float32":
        return torch.from_numpy(read_table(root, h.files.npy, h.files.parquet, shape,
                                           np.float32))
    if h.dtype not in NPY_DTYPES:
        raise ExportError(f"{where}: head.dtype: {h.dtype!r} is not one of "
                          f"{', '.join(NPY_DTYPES)}")
    if h.files.npy is None:
        raise ExportError(f"{where}: head.files.npy: a {h.dtype} head is read from its .npy")
    return torch.from_numpy(read_table(root, h.files.npy, None, shape,
                                       NPY_DTYPES[h.dtype])).view(TORCH_DTYPES[h.dtype])


def predict(export_dir: str | os.PathLike, inputs: Sequence[str], out: str | os.PathLike,
            batch_size: int = 8192, top_k: Optional[int] = None, progress: bool = True,
            raw: bool = False, keep: Sequence[str] = (), on_invalid: str = "drop",
            program: str = "export") -> PredictResult:
    """Scores every row of ``inputs`` with the export at ``export_dir`` into parquet ``out``
    (a GNN export: looks up the node ids of ``inputs``, :func:`embedtrain.export.nodes.
    predict_nodes`).

    Args:
        export_dir: an ``embedtrain export`` directory.
        inputs: parquet files, directories or globs (the data set's layout: its dense and
            sparse columns; the label is optional); with ``raw``, files in the raw layout the
            data set was ingested from.
        out: the predictions file (written anew).
        batch_size: rows scored at once.
        top_k: XC: classes per row (default: the run's largest ``head.top_k``).
        progress: show a progress bar (rows).
        raw: the inputs are raw rows, encoded by the data set's own ingestion
            (``pipelines.raw_rows``); rows it would drop are not scored but counted by reason
            and listed in ``<out>.invalid.parquet`` (file, row, line, reason, column).
        keep: input columns copied to the output as they are (an id to join the scores on).
        on_invalid: with ``raw``: ``drop`` (skip and count invalid rows) or ``error`` (stop at
            the first, one line).
        program: ``export`` (the ``torch.export`` program) or ``aot`` (the AOTInductor
            package, ``embedtrain export --aot``).

    Raises:
        ExportError, DataError, FileNotFoundError, IngestError: one line naming the file (and
            column, row).
    """
    start = time.perf_counter()
    if batch_size < 1:
        raise ValueError(f"--batch-size: must be at least 1, got {batch_size}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k: must be at least 1, got {top_k}")
    if load_manifest(export_dir).nodes is not None:  # GNN: every node's outputs, by node id
        given = [o for o, on in (("--raw", raw), ("--top-k", top_k is not None),
                                 ("--program aot", program != "export")) if on]
        if given:
            raise ValueError(f"{given[0]}: a GNN export's inputs are node ids, looked up in its "
                             f"per-node outputs (no rows to encode, no program to run)")
        from embedtrain.export.nodes import predict_nodes

        return predict_nodes(export_dir, inputs, out, batch_size=batch_size, progress=progress,
                             keep=keep)
    quiet_fx_tracing_warning()
    model = ExportedModel(export_dir, program=program)
    spec = model.spec
    source = (RawRows(model.root, spec, inputs, keep, on_invalid) if raw
              else ParquetRows(input_files(inputs), spec, keep))
    head = model.manifest.head
    k = top_k or (max(head.top_k) if head is not None else 0)
    if head is not None and k > head.num_classes:
        raise ValueError(f"--top-k {k}: more than the export's {head.num_classes:,} classes "
                         f"(every row would be padded, and hit rates trivially 1)")
    out = Path(out)
    check_output_file(out, "--out", example="predictions.parquet", inputs=source.files)
    if source.total == 0:
        files = source.files
        raise ValueError(f"{files[0] if len(files) == 1 else f'{len(files)} input files'}: no "
                         f"rows to score; nothing written to {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    metrics = None
    if source.label_type is not None:
        metrics = (_TopOneMetrics() if head is not None else _ClickMetrics(source.total)
                   if model.manifest.score == "sigmoid" else None)
    rows = 0
    where = source.files[0] if len(source.files) == 1 else "the inputs"
    with parquet_output(out, lambda: f"{where}: no valid row to score ("
                        f"{describe_invalid(source.invalid)}); nothing written to {out}"
                        ) as write, progress_bar(source.total, "predict",
                                                 disable=not progress) as bar:
        for path, first, table, labels, kept in source.batches(batch_size):
            check_rows(table, spec, path, first, model.id_maps)
            columns = _score(model, model_batch(table, spec), k)
            if metrics is not None:
                columns[spec.label] = labels
                metrics.update(columns, labels, f"{path}: column {spec.label}", first)
            columns.update(kept)
            result = pa.table(columns)
            write(result)
            rows += result.num_rows
            bar.update(result.num_rows)
    invalid_file = write_invalid(out, source.invalid_tables)
    return PredictResult(out, rows, len(source.files), time.perf_counter() - start,
                         metrics.compute() if metrics is not None else {},
                         dict(source.invalid), invalid_file)


def _score(model: ExportedModel, batch, k: int) -> dict[str, pa.Array]:
    """A batch's output columns: the class head's top ``k`` with a head, else the click logit
    and its probability."""
    if model.manifest.head is None:
        logits = model.outputs(batch.dense_features, batch.sparse_features).float()
        scores = torch.sigmoid(logits) if model.manifest.score == "sigmoid" else logits
        return {"logit": pa.array(logits.numpy()), "score": pa.array(scores.numpy())}
    scores, ids = model.topk(batch.dense_features, batch.sparse_features, k)
    n = ids.shape[0]
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return {"top_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1).numpy())),
            "top_scores": pa.ListArray.from_arrays(
                offsets, pa.array(scores.float().reshape(-1).numpy()))}


class _ClickMetrics:
    """The click probabilities (``score``) against the labels: AUC and log loss, the values
    torchmetrics' ``binary_auroc`` (exact: ties count half; a label below 1 is no click for it)
    and ``F.binary_cross_entropy`` (float64, probabilities clamped to ``[1e-12, 1 - 1e-12]``)
    give over all rows, in 4 bytes a labelled row: log loss is summed batch by batch; AUC needs
    every score, kept as the float32 the output holds, clicks from the front of one array,
    the others from its back, sorted in place at the end and counted in blocks (no per-row
    temporaries). ``rows``: the array's size, the rows to score where known (inputs of unknown
    size: it doubles as needed, up to twice the 4 bytes).
    """

    _BLOCK = 1 << 16  # clicks counted at once against the sorted non-clicks

    def __init__(self, rows: Optional[int] = None) -> None:
        self._scores = np.empty(max(int(rows or 0), 1024), np.float32)
        self._clicks = self._others = self.count = 0  # at the front, at the back, all
        self._loss = 0.0  # the sum of the rows' log losses

    def update(self, columns: dict[str, pa.Array], labels: pa.Array, where: str,
               first: int) -> None:
        valid = pc.is_valid(labels).to_numpy(zero_copy_only=False)
        if valid.any():
            y = labels.to_numpy(zero_copy_only=False)[valid].astype(np.float32)
            bad = np.flatnonzero(~((y >= 0) & (y <= 1)))
            if len(bad):  # before the output is in place: nothing written
                row = first + int(np.flatnonzero(valid)[bad[0]])
                raise ValueError(f"{where}: row {row}: label {y[bad[0]]:g} is not a click "
                                 f"(0..1); {len(bad):,} such rows in this batch")
            p = columns["score"].to_numpy()[valid]
            eps = 1e-12
            self._loss += F.binary_cross_entropy(
                torch.from_numpy(p).double().clamp(eps, 1 - eps), torch.from_numpy(y).double(),
                reduction="sum").item()
            self.count += len(y)
            clicks = y == 1  # binary_auroc's positives: the labels whose long() is 1
            self._keep(p[clicks], p[~clicks])

    def _keep(self, clicks: np.ndarray, others: np.ndarray) -> None:
        size = len(self._scores)
        need = self._clicks + self._others + len(clicks) + len(others)
        if need > size:  # more rows than announced: grown, both ends kept
            grown = np.empty(max(need, 2 * size), np.float32)
            grown[:self._clicks] = self._scores[:self._clicks]
            grown[len(grown) - self._others:] = self._scores[size - self._others:]
            self._scores, size = grown, len(grown)
        self._scores[self._clicks:self._clicks + len(clicks)] = clicks
        self._clicks += len(clicks)
        self._scores[size - self._others - len(others):size - self._others] = others
        self._others += len(others)

    def compute(self) -> dict[str, float]:
        if not self.count:
            return {}
        size = len(self._scores)
        clicks = self._scores[:self._clicks]
        others = self._scores[size - self._others:]
        clicks.sort()
        others.sort()
        # pairs (click, other) ranked right count 2, tied 1: the trapezoid of the ROC curve
        twice = 0
        for i in range(0, len(clicks), self._BLOCK):
            block = clicks[i:i + self._BLOCK]
            twice += int(np.searchsorted(others, block, "left").sum(dtype=np.int64))
            twice += int(np.searchsorted(others, block, "right").sum(dtype=np.int64))
        pairs = len(clicks) * len(others)
        # without clicks or without others, binary_auroc's rate is 0 and so its area
        auc = twice / (2 * pairs) if pairs else 0.0
        return {"auc": auc, "logloss": self._loss / self.count}


class _TopOneMetrics:
    """The best classes (``top_ids``) against the labels (a class id or a list of them): P@1,
    and with single-label rows the hit rate at ``k`` (the label among the ``k`` ids)."""

    def __init__(self) -> None:
        self.hits = self.count = self.found = self.single = 0
        self.k = 0

    def update(self, columns: dict[str, pa.Array], labels: pa.Array, where: str,
               first: int) -> None:
        valid = pc.is_valid(labels).to_numpy(zero_copy_only=False)
        if not valid.any():
            return
        for ok, ids, label in zip(valid, columns["top_ids"].to_pylist(), labels.to_pylist()):
            if not ok:
                continue
            self.count += 1
            guess = ids[0] if ids else -1
            if isinstance(label, list):
                self.hits += int(guess in label)
            else:
                self.hits += int(guess == label)
                self.single += 1
                self.found += int(label in ids)
                self.k = max(self.k, len(ids))

    def compute(self) -> dict[str, float]:
        out = {"p@1": self.hits / self.count} if self.count else {}
        if self.single == self.count and self.single:
            out[f"hr@{self.k}"] = self.found / self.single
        return out
