"""What exporting a family's model takes besides its tables: :class:`ExportParts` (what a
recipe's :meth:`~embedtrain.recipes.base.Recipe.export_parts` returns) and its pieces, the dense
program (:class:`DenseExport`), a class head (:class:`HeadExport`) and per-node outputs
(:class:`NodeOutputsExport`). :mod:`embedtrain.export.export` writes them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from embedtrain.features import FeatureSpec


@dataclass
class DenseExport:
    """A family's dense model as ``embedtrain export`` writes it (a ``torch.export`` program).

    Attributes:
        module: the model without its tables, on CPU; its parameters are loaded from the
            checkpoint.
        checkpoint_prefix: what the checkpoint's keys of ``module``'s parameters start with.
        example: inputs to trace and check the program with (batch dimension first, dynamic).
        inputs: what each input is, for ``model.json``.
        output: what the output is, for ``model.json``.
    """

    module: nn.Module
    checkpoint_prefix: str
    example: tuple[torch.Tensor, ...]
    inputs: list[str]
    output: str


@dataclass
class HeadExport:
    """A class head to export: ``num_classes`` x ``dim`` weights scoring ``features @ weight.T``
    (both L2-normalised and the features scaled by ``scale`` when ``normalised``)."""

    kind: str
    checkpoint_key: str
    num_classes: int
    dim: int
    normalised: bool
    scale: float
    top_k: list[int]
    vocab: Optional[str] = None  # the labels' vocabulary, relative to the data set's directory


@dataclass
class NodeOutputsExport:
    """Outputs ``embedtrain export`` computes for every node of a graph (GNN: layer-wise
    full-graph inference) and writes as ``nodes/<name>.npy``.

    Attributes:
        module: the model on CPU but for its tables (left on ``meta``: the node table is read
            from the export's own file); its other parameters are loaded from the checkpoint.
        checkpoint_prefix: what the checkpoint's keys of ``module``'s parameters start with.
        table: the table whose rows are the nodes' id embeddings, or None (no table).
        arrays: ``{name: what it is}`` of the arrays written, the model's output first.
        compute: ``compute(module, node_embeddings, files, progress)`` writes each array to
            ``files[name]``; ``node_embeddings`` maps int64 node ids to their table rows
            (None: no table).
        ids: the data set's original node ids (``nodes/ids.parquet``) to copy, if any.
    """

    module: nn.Module
    checkpoint_prefix: str
    table: Optional[str]
    arrays: dict[str, str]
    compute: Callable[[nn.Module, Optional[Callable[[torch.Tensor], torch.Tensor]],
                       dict[str, Path], bool], None]
    ids: Optional[Path] = None


@dataclass
class ItemsExport:
    """A retrieval model's item side, computed at export: every item's embedding by the item
    tower over the item tables written with the others, then a FAISS index of them.

    Attributes:
        module: the item tower after its lookups (``(dense [n, 0], pooled [n, tables, D]) ->
            [n, D]`` unit rows), on CPU; its parameters are loaded from the checkpoint.
        checkpoint_prefix: what the checkpoint's keys of ``module``'s parameters start with.
        tables: the item tables, in the module's input order.
        columns: per table, the item table's column it looks up (the id column: the item's own
            id).
        rows: ``[items, tables]``: the row each item looks up in each table.
        item_table: the data set's item table file (copied into the export).
        top_k: the run's cut-offs (predict's default k: the largest).
    """

    module: nn.Module
    checkpoint_prefix: str
    tables: list[str]
    columns: list[str]
    rows: torch.Tensor
    item_table: Path
    top_k: list[int]


@dataclass
class ExportParts:
    """What exporting a family's model takes besides its tables (which ``embedtrain export``
    reads from the model itself).

    Attributes:
        model: the model's name in ``model.json`` (``dlrm``, ``dcn``, ``xc``, ``graphsage``,
            ``sasrec``, ``hstu``).
        features: the columns a row carries; each sparse feature is looked up in the table of
            the same feature.
        ingest: how ``embedtrain ingest`` made the columns (``metadata.json``'s extra fields:
            ``dense_stats``, ``spec``, ``vocab_files``, ``hash_buckets``, ...); ``{}``: none.
        dense: the dense program; None: none (the tables are the whole export).
        head: a class head; None: none.
        note: a line for ``model.json`` on what the export leaves out.
        nodes: per-node outputs to compute and write (GNN); None: none.
        score: how predict scores a row from the dense program's output: ``sigmoid`` (a click
            probability) or ``identity`` (the task's :attr:`score`).
        items: a retrieval model's item side (the dense program is then the query tower).
    """

    model: str
    features: FeatureSpec
    ingest: dict[str, Any] = dataclasses.field(default_factory=dict)
    dense: Optional[DenseExport] = None
    head: Optional[HeadExport] = None
    note: Optional[str] = None
    nodes: Optional[NodeOutputsExport] = None
    score: str = "sigmoid"
    items: Optional[ItemsExport] = None  # retrieval: the item side, computed and indexed
