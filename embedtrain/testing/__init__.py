"""Helpers for tests: tiny synthetic data sets and random parquet files with known contents.

Shipped in the package (like PyG's ``torch_geometric.testing``) so that downstream users can test
their own tasks against the same fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.features import FeatureSpec, SparseFeature


def tiny_ctr_dataset(out_dir: str | os.PathLike, rows: int = 4000, seed: int = 0) -> Path:
    """A small synthetic CTR data set (``embedtrain datagen ctr``) with several row groups."""
    from embedtrain.datagen import CTRDataSpec, generate_ctr

    generate_ctr(CTRDataSpec(rows=rows, seed=seed, rows_per_row_group=512), out_dir, progress=False)
    return Path(out_dir)


def tiny_xc_dataset(out_dir: str | os.PathLike, rows: int = 4000, classes: int = 200,
                    seed: int = 0, multi_label: bool = False) -> Path:
    """A small extreme-classification data set (``embedtrain datagen xc``), several row groups."""
    from embedtrain.datagen import XCDataSpec, generate_xc

    generate_xc(XCDataSpec(classes=classes, rows=rows, vocab=2_000, noise=0.5, seed=seed,
                           multi_label=multi_label, rows_per_row_group=1_000), out_dir,
                progress=False)
    return Path(out_dir)


def tiny_seq_dataset(out_dir: str | os.PathLike, users: int = 2000, items: int = 300,
                     seed: int = 0) -> Path:
    """A small sequential-recommendation data set (``embedtrain datagen seq``)."""
    from embedtrain.datagen import SeqDataSpec, generate_seq

    generate_seq(SeqDataSpec(users=users, items=items, clusters=5, max_length=10, seed=seed),
                 out_dir, progress=False)
    return Path(out_dir)


def tiny_retrieval_dataset(out_dir: str | os.PathLike, users: int = 1000, items: int = 300,
                           seed: int = 0) -> Path:
    """A small retrieval data set (``embedtrain datagen retrieval``)."""
    from embedtrain.datagen.retrieval import RetrievalDataSpec, generate_retrieval

    generate_retrieval(RetrievalDataSpec(users=users, items=items, brands=30, categories=6,
                                         segments=5, max_length=8, seed=seed, attributes=0,
                                         mean_extra_events=6.0, max_events=50),
                       out_dir, progress=False)
    return Path(out_dir)


def tiny_graph_dataset(out_dir: str | os.PathLike, nodes: int = 2000, seed: int = 0,
                       link_fraction: float = 0.1) -> Path:
    """A small graph data set (``embedtrain datagen graph``) with node splits and held-out edges."""
    from embedtrain.datagen import GraphDataSpec, generate_graph

    generate_graph(GraphDataSpec(nodes=nodes, avg_degree=8, communities=4, seed=seed,
                                 link_fraction=link_fraction), out_dir, progress=False)
    return Path(out_dir)


def random_ctr_table(
    rows: int,
    seed: int = 0,
    num_dense: int = 3,
    vocab_sizes: tuple[int, ...] = (7, 50, 1000),
    list_features: tuple[int, ...] = (1,),
    max_length: int = 4,
) -> tuple[pa.Table, FeatureSpec]:
    """A random table in the reader's layout and its spec.

    Args:
        rows: number of rows.
        seed: RNG seed.
        num_dense: dense float columns ``d0..``.
        vocab_sizes: one sparse column ``s<i>`` per entry.
        list_features: indices of sparse columns that are lists (lengths 0..max_length).
        max_length: longest list.

    Returns:
        ``(table, spec)``; row ``r`` of the table has label ``r % 2`` so rows stay identifiable.
    """
    rng = np.random.default_rng(seed)
    columns = {"label": pa.array((np.arange(rows) % 2).astype(np.int8))}
    for j in range(num_dense):
        columns[f"d{j}"] = pa.array(rng.normal(size=rows).astype(np.float32))
    sparse = []
    for i, vocab in enumerate(vocab_sizes):
        name = f"s{i}"
        if i in list_features:
            lengths = rng.integers(0, max_length + 1, size=rows)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = rng.integers(0, vocab, size=int(offsets[-1]))
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            sparse.append(SparseFeature(name, vocab, multi_hot=True, max_length=max_length))
        else:
            columns[name] = pa.array(rng.integers(0, vocab, size=rows))
            sparse.append(SparseFeature(name, vocab))
    spec = FeatureSpec(label="label", dense=tuple(f"d{j}" for j in range(num_dense)), sparse=tuple(sparse))
    return pa.table(columns), spec


def write_parquet(table: pa.Table, path: str | os.PathLike, row_group_size: Optional[int] = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def tiny_ctr_tsv(out_dir: str | os.PathLike, rows: int = 4000, seed: int = 0,
                 rows_per_file: int = 1_000_000) -> list[Path]:
    """The synthetic CTR data as raw Criteo-style TSV (``embedtrain datagen ctr --format tsv``).

    Returns:
        The TSV files written.
    """
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    info = generate_ctr_tsv(CTRDataSpec(rows=rows, seed=seed, rows_per_file=rows_per_file),
                            out_dir, progress=False)
    return [Path(out_dir) / f for f in info["files"]]


def random_embedding_tables(
    n: int,
    seed: int = 0,
    log10_rows: tuple[float, float] = (3.0, 8.0),
    dims: tuple[int, ...] = (32, 64, 128, 256),
) -> list:
    """``n`` TorchRec table configs with log-uniform row counts and dims drawn from ``dims``.

    With the defaults this is the planner benchmark's model (and ``../shared/anchors``'s).
    """
    import random

    from torchrec import EmbeddingBagConfig

    rng = random.Random(seed)
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=rng.choice(dims),
            num_embeddings=int(10 ** rng.uniform(*log10_rows)),
            feature_names=[f"f{i}"],
        )
        for i in range(n)
    ]
