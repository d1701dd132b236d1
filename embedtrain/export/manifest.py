"""``model.json``: what an export directory holds and what its inputs need (schema, read, write).

An export (``embedtrain export RUN_DIR --out DIR``) is a directory::

    DIR/model.json                this manifest
    DIR/dense.pt2                 the dense model, a torch.export program (dense.ts: TorchScript)
    DIR/dense.aoti.pt2            with --aot: that program compiled by AOTInductor (C++ kernels
                                  and weights; torch._inductor.aoti_load_package runs it)
    DIR/tables/<table>.npy        float32 [rows, dim] per embedding table (row = id)
    DIR/tables/<table>.int8.npy   or, quantized: uint8 [rows, dim + 4] fused rows (FBGEMM's
                                  layout: dim codes, then fp16 scale and fp16 bias; int4:
                                  dim / 2 bytes of codes)
    DIR/tables/<table>.parquet    with --format parquet: id (int64, the row), vector
                                  (list<float32>)
    DIR/tables/<table>.ids.parquet  dynamic tables: the id -> row map (see below)
    DIR/head/weight.npy           XC: the class head, [classes, D] (row = class id): float32,
                                  or for a bfloat16 head (head.dtype: bfloat16) uint16 holding
                                  the bfloat16 bit patterns (NumPy has no bfloat16; in torch:
                                  torch.from_numpy(a).view(torch.bfloat16)), for a float8 one
                                  (head.dtype: float8_e4m3fn) uint8 bit patterns
    DIR/head/weight.parquet       with --format npy,parquet: id, vector (list<float32>; a
                                  bfloat16 or float8 head's values widened exactly)
    DIR/nodes/scores.npy          GNN node classification: float32 [N, classes], every node's
                                  class logits (row = dense node id), by layer-wise full-graph
                                  inference (no sampling)
    DIR/nodes/embeddings.npy      GNN: float32 [N, D]: node classification, the last SAGE
                                  layer's output (what the class layer scores); link
                                  prediction, the embeddings whose dot products score a link
    DIR/nodes/ids.parquet         GNN, where the data set has them: its original node ids (id,
                                  row = dense id), copied
    DIR/items/embeddings.npy      retrieval: float32 [items, D], every item's embedding by the
                                  item tower (row = item id); items/items.parquet the item
                                  table, items/dense.pt2 the item tower after its lookups,
                                  items/index.faiss a FAISS index of the embeddings
    DIR/vocab/<feature>.parquet   ingested features' vocabularies (value, id, count), copied
    DIR/config.yaml               the run's resolved config, copied
    DIR/dataset_metadata.json     the data set's metadata.json, copied

The manifest is plain JSON mapped onto the dataclasses below (:func:`load_manifest` checks keys
and types, one line naming the file and key). Paths in it are relative to the export directory.
``features`` says what a row must carry and how raw data became those values:
``features.dense[i].transform`` is applied by the reader to the stored value (``log1p`` for the
synthetic Criteo counts), ``features.dense[i].ingest`` is what ``embedtrain ingest`` did to the
raw column first (fill, clip, log1p, standardisation with the training split's mean and std);
``features.sparse[i].encoding`` is how raw values became ids (``pre_encoded``, ``vocab`` with its
file, ``hash`` with its buckets, ``bucketize``/``quantiles`` with their boundaries; id 0 is the
null/unknown bucket of ingested features; ``raw``: raw int64 ids in ``[0, 2^63 - 1)``, looked up
through a dynamic table's id map).

Dynamic tables (``tables: [{tables: [...], capacity: N}]`` in the training config,
:mod:`embedtrain.tables.dynamic`) are not indexed by id: their ``rows`` (the capacity) are owned
by the ids training admitted and kept. Such a table's entry has ``id_map``, the file
``tables/<table>.ids.parquet`` with columns ``id`` (int64, the raw id as the data holds it) and
``row`` (int64, its row of the table), sorted by ``id``, one entry per id that owns a row
(``ids_held`` of them; distinct ids, distinct rows, never a default row), read from the
checkpoint's remapping state (the remapper keeps ids mixed by
:func:`embedtrain.tables.dynamic.mix_ids`; the file holds them unmixed). An id without a row
-- never seen in training, or evicted -- looks up a default row, one per row-wise shard of the
run: ``segments`` are the shards' first rows followed by the table's rows (``[0, rows]`` for a
1-rank run), ``default_rows[i] = segments[i + 1] - 1`` (the last row of each shard). Serving
maps an id exactly as training's evaluation did: binary search for it in ``id`` (found: its
``row``), else ``default_rows[shard]`` with ``shard = mix_ids(id) // ceil((2^63 - 1) /
len(default_rows))``, the shard whose block of the mixed id range holds it
(:func:`embedtrain.tables.dynamic.checkpoint_default_rows`, which :mod:`embedtrain.export.
predict` calls). A dynamic table over a feature that is not raw (say, ``pre_encoded`` ids) keeps
that feature's ``encoding`` and is mapped the same way.

Example:
    >>> m = load_manifest("exports/demo")
    >>> m.task, [t.name for t in m.tables][:2], m.tables[0].files.npy
    ('ctr', ['t_C1', 't_C2'], 'tables/t_C1.npy')
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from embedtrain.config_io import ConfigError, from_dict, to_dict

MANIFEST_FILE = "model.json"
FORMAT_VERSION = 1
QUANTIZE = ("none", "int8", "int4")  # table formats: float32, or FBGEMM's fused rowwise n-bit
BITS = {"int8": 8, "int4": 4}


class ExportError(ValueError):
    """An export directory or its manifest is unusable; the message names the file and key."""


@dataclass
class Shard:
    """One shard of a checkpointed tensor, as DCP stored it (rank-local rows and columns)."""

    row_offset: int
    col_offset: int
    rows: int
    cols: int


@dataclass
class TableFiles:
    """Where a table (or the class head) is written; ``None``: not in this format."""

    npy: Optional[str] = None
    parquet: Optional[str] = None


@dataclass
class Table:
    """An embedding table: ``rows`` ids of ``dim`` values, pooled per bag by ``pooling``.

    ``dtype`` is ``float32`` or the quantization (``int8``, ``int4``: fused rows of codes plus
    fp16 scale and bias, as TorchRec's quantized ``EmbeddingBagCollection`` holds them);
    ``bytes`` is the size of its ``npy`` file's data, ``float32_bytes`` that of the float table.
    """

    name: str
    features: list[str]
    rows: int
    dim: int
    pooling: str
    dtype: str
    files: TableFiles
    bytes: int
    float32_bytes: int
    checkpoint_key: str
    shards: list[Shard] = field(default_factory=list)
    vocab: Optional[str] = None  # the vocabulary of its feature (ingested data), if any
    # Dynamic tables only (None: a static table, row = id); see the module docstring.
    id_map: Optional[str] = None  # tables/<name>.ids.parquet: id, row (int64), sorted by id
    segments: Optional[list[int]] = None  # the run's row-wise shards' first rows, then rows
    default_rows: Optional[list[int]] = None  # per shard: segments[i + 1] - 1
    ids_held: Optional[int] = None  # entries of the id map (ids that own a row)
    id_mix: Optional[str] = None  # the version of mix_ids the shard of an id is found with

    @property
    def dynamic(self) -> bool:
        """Whether ids reach rows through :attr:`id_map` (a dynamic table)."""
        return self.id_map is not None


@dataclass
class DensePreprocessing:
    """What ``embedtrain ingest`` did to a raw dense column (in this order), from its spec."""

    fill_null: float = 0.0
    cast: Optional[str] = None
    clip_min: Optional[float] = None
    clip_max: Optional[float] = None
    log1p: bool = False
    standardize: bool = False
    mean: Optional[float] = None  # the training split's, after fill/clip/log1p
    std: Optional[float] = None


@dataclass
class DenseFeature:
    name: str
    transform: str = "none"  # applied to the stored value when rows are read: none | log1p
    ingest: Optional[DensePreprocessing] = None


@dataclass
class SparseFeature:
    name: str
    table: str
    num_embeddings: int
    multi_hot: bool = False
    max_length: int = 1
    encoding: str = "pre_encoded"  # pre_encoded | vocab | hash | bucketize | quantiles | raw
    column: Optional[str] = None  # the raw input column (ingest), when it is not ``name``
    vocab: Optional[str] = None  # vocab: the file (value, id, count) in the export
    min_frequency: Optional[int] = None
    hash_buckets: Optional[int] = None  # hash: id = 1 + string_hash(value) % (buckets - 1)
    bucket_boundaries: Optional[list[float]] = None  # id = 1 + #{b <= x}
    null_id: Optional[int] = None  # the id of null / unknown values (ingested features: 0)


@dataclass
class Features:
    """The columns a row carries: the label (optional at predict time), dense and sparse."""

    label: str
    dense: list[DenseFeature]
    sparse: list[SparseFeature]
    num_classes: Optional[int] = None
    max_labels: int = 1


@dataclass
class DenseProgram:
    """The dense model: everything but the embedding tables (and the XC class head)."""

    file: str
    format: str  # torch.export | torchscript
    inputs: list[str]
    output: str
    parameters: int
    # --aot: the program's AOTInductor package (dense.aoti.pt2), same inputs and output, inputs
    # contiguous; None: not compiled (and every export written before --aot existed)
    aot: Optional[str] = None


@dataclass
class Head:
    """An XC class head: ``num_classes`` x ``dim`` weights; scores are ``features @ weight.T``
    (both L2-normalised and the features scaled by ``scale`` when ``normalised``).

    ``dtype`` is what training held and the ``npy`` file stores: ``float32``, or ``bfloat16``
    (``uint16`` bit patterns) or ``float8_e4m3fn`` (``uint8``; manifests written before either
    existed read as ``float32``);
    ``bytes`` is the size of that file's data.
    """

    kind: str
    num_classes: int
    dim: int
    files: TableFiles
    bytes: int
    checkpoint_key: str
    normalised: bool = False
    scale: float = 1.0
    top_k: list[int] = field(default_factory=lambda: [1, 5])
    shards: list[Shard] = field(default_factory=list)
    vocab: Optional[str] = None  # ingested labels: class id -> label value
    dtype: str = "float32"  # float32 | bfloat16 | float8_e4m3fn


@dataclass
class NodeArray:
    """One per-node array of a GNN export: float32 ``[rows, dim]``, row = dense node id."""

    name: str  # scores | embeddings
    file: str  # nodes/<name>.npy
    rows: int
    dim: int
    what: str


@dataclass
class NodeOutputs:
    """A GNN export's per-node outputs, computed at export for every node by layer-wise
    full-graph inference (:mod:`embedtrain.models.layerwise`: each layer over all nodes with
    their full neighbourhoods, no sampling).

    ``output`` names the array that is the model's output, which ``embedtrain predict`` writes
    per node: ``scores`` (node classification: class logits) or ``embeddings`` (link prediction:
    the embeddings whose dot products score a link). ``ids``: the data set's original node ids
    (``nodes/ids.parquet``, column ``id``, row = dense id), when it has them.
    """

    num_nodes: int
    output: str
    arrays: list[NodeArray]
    ids: Optional[str] = None
    method: str = "layerwise"

    def array(self, name: str) -> Optional[NodeArray]:
        """The array called ``name``, or None."""
        return next((a for a in self.arrays if a.name == name), None)


@dataclass
class ItemIndex:
    """A retrieval export's item side: every item's embedding (``head``: ``items/
    embeddings.npy``, unit rows, scores ``<query, item>``), the item table (``items/
    items.parquet``: ``item`` ids ``0..N-1`` and the feature columns), the item tower after its
    lookups (``program``: pooled ``[n, len(tables), D]`` -> ``[n, D]``, for items added later) and
    a FAISS index of the embeddings (``index``: ``flat``, exact inner product; ``hnsw`` or
    ``ivf`` above ``threshold`` items, with their search parameters). ``recall_at_10_vs_exact``:
    the index's top 10 against exact search, measured at export on ``recall_queries`` queries
    (each the normalised sum of two random items' embeddings)."""

    num_items: int
    table: str
    features: list[str]  # the item table's columns each tower table looks up, in order
    tables: list[str]  # the embedding tables the item tower looks up, in its input order
    program: str
    index: str
    index_file: str
    params: dict[str, int] = field(default_factory=dict)
    recall_at_10_vs_exact: float = 1.0
    recall_queries: int = 0
    build_s: float = 0.0
    threshold: int = 0
    added_items: int = 0  # items added after export (embedtrain export --add-items)


@dataclass
class Source:
    """Where the export came from."""

    run_dir: str
    checkpoint: str
    step: int
    world_size: int
    dataset: str
    dataset_name: str
    config: str = "config.yaml"
    dataset_metadata: str = "dataset_metadata.json"


@dataclass
class Manifest:
    """``model.json``."""

    format_version: int
    task: str
    model: str  # dlrm | dcn | xc | graphsage | sasrec | hstu
    quantize: str
    features: Features
    tables: list[Table]
    source: Source
    dense_program: Optional[DenseProgram] = None
    head: Optional[Head] = None
    note: Optional[str] = None
    nodes: Optional[NodeOutputs] = None  # GNN: every node's outputs (nodes/*.npy)
    items: Optional[ItemIndex] = None  # retrieval: the item side (items/*)
    # no class head: a row's score from the dense program's output, sigmoid (the click
    # probability) or identity (a regression's value)
    score: str = "sigmoid"

    @property
    def table_bytes(self) -> int:
        return sum(t.bytes for t in self.tables)

    @property
    def float32_bytes(self) -> int:
        return sum(t.float32_bytes for t in self.tables)


def write_manifest(manifest: Manifest, root: str | os.PathLike) -> Path:
    """Writes ``root/model.json``."""
    path = Path(root) / MANIFEST_FILE
    path.write_text(json.dumps(to_dict(manifest), indent=2) + "\n")
    return path


def load_manifest(root: str | os.PathLike) -> Manifest:
    """Reads ``root/model.json``.

    Raises:
        ExportError: no such file, invalid JSON, a missing or mistyped key, another format
            version (file and key named).
    """
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        hint = "" if Path(root).is_dir() else " (the directory does not exist)"
        raise ExportError(f"{path}: not an export (no {MANIFEST_FILE}; write one with: "
                          f"embedtrain export RUN_DIR --out DIR){hint}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable: {e}") from None
    if isinstance(raw, dict) and raw.get("format_version") not in (None, FORMAT_VERSION):
        raise ExportError(f"{path}: format_version {raw['format_version']!r} is not "
                          f"{FORMAT_VERSION} (written by another version of embedtrain)")
    try:
        return from_dict(Manifest, raw, source=str(path), ignore_unknown=True)
    except ConfigError as e:
        raise ExportError(str(e)) from None
