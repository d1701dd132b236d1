"""A retrieval export's item side (family-free): every item's embedding by the item tower over
the exported tables, a FAISS index of them with its recall against exact search, and items added
to an export without retraining.

The index (``faiss-cpu``, inner product on unit rows): ``flat`` (exact) up to
:data:`AUTO_FLAT_MAX` items with ``index: auto``, ``hnsw`` (``IndexHNSWFlat``, ``M`` 32) above,
or ``ivf`` (``IndexIVFFlat``, ``4 sqrt(N)`` lists, at most 8,192, trained on 32 vectors a list)
when asked. An approximate index's search parameter (HNSW's ``efSearch``, IVF's ``nprobe``) is
the smallest of a doubling ladder whose top 10 reach :data:`TARGET_RECALL` of exact search's on
:data:`RECALL_QUERIES` queries, each the normalised sum of two random items' embeddings (queries
near the items, as a query tower's are); the recall reached is written to ``model.json``.

Example:
    >>> index, params, recall = build_index(embeddings, "hnsw")
    >>> scores, ids = search(index, queries, 10)
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from embedtrain.export.manifest import ExportError, Head, ItemIndex, TableFiles
from embedtrain.export.programs import export_program, load_module, load_program
from embedtrain.recipes.export_parts import ItemsExport
from embedtrain.utils import progress_bar, writing

ITEMS_DIR = "items"
EMBEDDINGS, TABLE, INDEX = "items/embeddings.npy", "items/items.parquet", "items/index.faiss"
AUTO_FLAT_MAX = 200_000
TARGET_RECALL = 0.95
RECALL_QUERIES = 1_000
INDEX_KINDS = ("auto", "flat", "hnsw", "ivf")
_BLOCK = 65_536


def _faiss():
    try:
        import faiss
    except ImportError:  # pragma: no cover - faiss-cpu is in the pinned stack
        raise ExportError("retrieval exports need faiss-cpu (pip install faiss-cpu)") from None
    return faiss


def sample_queries(embeddings: np.ndarray, n: int = RECALL_QUERIES, seed: int = 0
                   ) -> np.ndarray:
    """``n`` queries near the items: the normalised sums of random pairs of their rows."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, len(embeddings), size=(min(n, len(embeddings)), 2))
    q = embeddings[pairs[:, 0]] + embeddings[pairs[:, 1]]
    return (q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def exact_top(embeddings: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The ids of each query's ``k`` highest inner products, by blocks of items."""
    best_s = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    for lo in range(0, len(embeddings), _BLOCK):
        s = queries @ np.asarray(embeddings[lo:lo + _BLOCK]).T
        cand_s = np.concatenate([best_s, s], 1)
        cand_i = np.concatenate([best_i, np.broadcast_to(np.arange(lo, lo + s.shape[1]),
                                                         s.shape)], 1)
        if cand_s.shape[1] > k:  # the block's k best (partition), then only those sorted
            part = np.argpartition(-cand_s, k - 1, axis=1)[:, :k]
            cand_s = np.take_along_axis(cand_s, part, 1)
            cand_i = np.take_along_axis(cand_i, part, 1)
        keep = np.lexsort((cand_i, -cand_s), axis=1)  # best first, ties by id
        best_s = np.take_along_axis(cand_s, keep, 1)
        best_i = np.take_along_axis(cand_i, keep, 1)
    return best_i


def recall_at_10(index, exact: np.ndarray, queries: np.ndarray) -> float:
    _, got = index.search(queries, 10)
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]))


def set_search_params(index, kind: str, params: dict[str, int]) -> None:
    """What an index searches with (not kept in its file by every FAISS version)."""
    if kind == "hnsw":
        index.hnsw.efSearch = params["ef_search"]
    elif kind == "ivf":
        index.nprobe = params["nprobe"]


def build_index(embeddings: np.ndarray, kind: str = "auto", seed: int = 0
                ) -> tuple[object, str, dict[str, int], float]:
    """A FAISS index of ``embeddings`` (float32 unit rows): ``(index, kind, params, recall@10
    against exact search)``; ``kind`` ``auto`` picks ``flat`` up to :data:`AUTO_FLAT_MAX`."""
    faiss = _faiss()
    if kind not in INDEX_KINDS:
        raise ExportError(f"--index: {kind!r} is not one of {', '.join(INDEX_KINDS)}")
    n, d = embeddings.shape
    if kind == "auto":
        kind = "flat" if n <= AUTO_FLAT_MAX else "hnsw"
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
        for lo in range(0, n, _BLOCK):
            index.add(np.ascontiguousarray(embeddings[lo:lo + _BLOCK], dtype=np.float32))
        return index, kind, {}, 1.0
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        params = {"M": 32, "ef_construction": 80}
        ladder, name = (16, 32, 64, 128, 256, 512, 1024), "ef_search"
    else:
        nlist = int(min(8_192, max(16, 4 * np.sqrt(n))))  # k-means cost: sample x nlist
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(n, size=min(n, 32 * nlist), replace=False))
        index.train(np.ascontiguousarray(embeddings[sample], dtype=np.float32))
        params = {"nlist": nlist}
        ladder, name = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), "nprobe"
        ladder = tuple(p for p in ladder if p < nlist) + (nlist,)
    for lo in range(0, n, _BLOCK):
        index.add(np.ascontiguousarray(embeddings[lo:lo + _BLOCK], dtype=np.float32))
    queries = sample_queries(embeddings, seed=seed)
    exact = exact_top(embeddings, queries, 10)
    recall = 0.0
    for value in ladder:
        params[name] = value
        set_search_params(index, kind, params)
        recall = recall_at_10(index, exact, queries)
        if recall >= TARGET_RECALL:
            break
    return index, kind, params, recall


def write_index(index, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with writing(path):
        _faiss().write_index(index, str(tmp))
        os.replace(tmp, path)


def read_index(root: Path, items: ItemIndex):
    """The export's index, with its search parameters set."""
    index = _faiss().read_index(str(root / items.index_file))
    set_search_params(index, items.index, items.params)
    return index


def search(index, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [B, k], ids [B, k])`` of an index (padded with ``-inf``, ``-1``)."""
    scores, ids = index.search(np.ascontiguousarray(queries.float().numpy()), k)
    scores = torch.from_numpy(scores)
    ids = torch.from_numpy(ids)
    return scores.masked_fill(ids < 0, float("-inf")), ids


def write_item_side(module: torch.nn.Module, lookups: list[Callable[[torch.Tensor],
                                                                      torch.Tensor]],
                    rows: torch.Tensor, out: Path, progress: bool = False) -> np.ndarray:
    """Every item's embedding (``module`` over its rows of each table, ``lookups``), written
    into ``out/items/embeddings.npy`` block by block; returns it memory-mapped."""
    n = rows.shape[0]
    with torch.no_grad():
        dim = module(torch.zeros(1, 0), torch.stack([f(rows[:1, j]) for j, f in
                                                     enumerate(lookups)], 1)).shape[1]
    path = out / EMBEDDINGS
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, dim))
    with torch.no_grad(), progress_bar(n, "item embeddings", disable=not progress) as bar:
        for lo in range(0, n, _BLOCK):
            block = rows[lo:lo + _BLOCK]
            pooled = torch.stack([f(block[:, j]) for j, f in enumerate(lookups)], 1)
            array[lo:lo + len(block)] = module(torch.zeros(len(block), 0), pooled).numpy()
            bar.update(len(block))
    array.flush()
    return np.load(path, mmap_mode="r")


def item_entries(embeddings: np.ndarray, kind: str, tables: list[str], columns: list[str],
                 program: str, item_table: Path, top_k: list[int], out: Path
                 ) -> tuple[Head, ItemIndex]:
    """Indexes the written embeddings, copies the item table; the manifest's entries."""
    start = time.perf_counter()
    index, kind, params, recall = build_index(embeddings, kind)
    write_index(index, out / INDEX)
    with writing(out / TABLE):
        shutil.copyfile(item_table, out / TABLE)
    n, dim = embeddings.shape
    head = Head(kind="items", num_classes=n, dim=dim, files=TableFiles(npy=EMBEDDINGS),
                bytes=n * dim * 4, checkpoint_key="", top_k=list(top_k))
    return head, ItemIndex(
        num_items=n, table=TABLE, features=list(columns), tables=list(tables), program=program,
        index=kind, index_file=INDEX, params=params, recall_at_10_vs_exact=recall,
        recall_queries=min(RECALL_QUERIES, n) if kind != "flat" else 0,
        build_s=time.perf_counter() - start, threshold=AUTO_FLAT_MAX)


def export_item_side(items: ItemsExport, ckpt: Path, out: Path, index: str,
               progress: bool) -> tuple[Head, ItemIndex]:
    """Loads the item tower from the checkpoint, embeds every item over the item tables written
    at ``out/tables`` (``out/items/embeddings.npy``), writes the tower's program and indexes the
    embeddings (:mod:`embedtrain.export.items`)."""
    module = load_module(ckpt, items.module, items.checkpoint_prefix)
    (out / ITEMS_DIR).mkdir()
    lookups = [table_rows(np.load(out / "tables" / f"{name}.npy", mmap_mode="r"))
               for name in items.tables]
    embeddings = write_item_side(module, lookups, items.rows, out, progress)
    dim = lookups[0](items.rows[:1, 0]).shape[1]
    file, _ = export_program(module, (torch.zeros(4, 0), torch.randn(4, len(lookups), dim)),
                             out / ITEMS_DIR)
    return item_entries(embeddings, index, items.tables, items.columns, f"{ITEMS_DIR}/{file}",
                        items.item_table, items.top_k, out)


def table_rows(weights: np.ndarray) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids -> rows of an exported float table; an id past its rows (an item added after
    training has no row of its own id) looks up zeros."""
    def lookup(ids: torch.Tensor) -> torch.Tensor:
        inside = ids < weights.shape[0]
        out = torch.zeros(len(ids), weights.shape[1])
        if inside.any():
            out[inside] = torch.from_numpy(np.asarray(weights[ids[inside].numpy()]))
        return out

    return lookup


def optional_index(kind: Optional[str]) -> str:
    kind = kind or "auto"
    if kind not in INDEX_KINDS:
        raise ExportError(f"--index: {kind!r} is not one of {', '.join(INDEX_KINDS)}")
    return kind


def versioned(name: str, total: int) -> str:
    """``items/embeddings.npy`` (or ``items/embeddings-<n>.npy``) as ``items/embeddings-<total>
    .npy``: the file's name once the export holds ``total`` items."""
    path = Path(name)
    stem = re.sub(r"-\d+$", "", path.name[: -len(path.suffix)] if path.suffix else path.name)
    return (path.parent / f"{stem}-{total}{path.suffix}").as_posix()


def add_items(export_dir: str | os.PathLike, items_file: str | os.PathLike) -> ItemIndex:
    """Adds the items of ``items_file`` (parquet: the item table's feature columns; an ``item``
    id column, if given, must number them on from the export's items) to a retrieval export
    without retraining: each embedded by the exported item tower over the exported tables (an
    added item has no row of its own id: zeros), appended to ``items/embeddings.npy`` and
    ``items/items.parquet`` and added to the index. The three are written under new names
    (:func:`versioned`) and ``model.json`` is swapped to name them in one ``os.replace``: a
    server that reloads on ``model.json`` sees the old items or the new, never half, and a crash
    leaves the old export whole.

    Raises:
        ExportError: not a retrieval export, or a bad items file (one line naming the file,
            column and row).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from embedtrain.export.manifest import load_manifest, write_manifest

    root, path = Path(export_dir), Path(items_file)
    m = load_manifest(root)
    if m.items is None:
        raise ExportError(f"{root / 'model.json'}: a {m.task} export has no item side (add "
                          f"items to a retrieval export)")
    items, n = m.items, m.items.num_items
    old = pq.read_table(root / items.table)
    id_column = old.column_names[0]
    try:
        new = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise ExportError(f"{path}: not a readable parquet file ({e})") from None
    count = new.num_rows
    if count == 0:
        raise ExportError(f"{path}: no items to add")
    ids = np.arange(n, n + count, dtype=np.int64)
    if id_column in new.column_names:
        given = new.column(id_column).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(given != ids)
        if len(bad):
            raise ExportError(f"{path}: column {id_column}, row {bad[0]}: id {given[bad[0]]}; "
                              f"added items number on from the export's {n:,} ({n} first)")
    rows = []
    for table, column in zip(items.tables, items.features):
        if column == id_column:
            rows.append(torch.from_numpy(ids))
            continue
        if column not in new.column_names:
            raise ExportError(f"{path}: no column {column} (an item's {column} is what the "
                              f"item tower looks up in {table})")
        values = new.column(column)
        limit = next(t.rows for t in m.tables if t.name == table)
        array = values.to_numpy(zero_copy_only=False) if values.null_count == 0 else None
        bad = (np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
               if array is None else np.flatnonzero((array < 0) | (array >= limit)))
        if len(bad):
            what = "null" if array is None else f"id {array[bad[0]]} outside [0, {limit})"
            raise ExportError(f"{path}: column {column}, row {bad[0]}: {what}")
        rows.append(torch.from_numpy(array.astype(np.int64)))
    rows_t = torch.stack(rows, 1)
    program = load_program(root / items.program, "torchscript" if items.program.endswith(
        ".ts") else "torch.export")
    lookups = [table_rows(np.load(root / "tables" / f"{t}.npy", mmap_mode="r"))
               for t in items.tables]
    with torch.no_grad():
        pooled = torch.stack([f(rows_t[:, j]) for j, f in enumerate(lookups)], 1)
        added = program(torch.zeros(count, 0), pooled).numpy().astype(np.float32)
    embeddings = np.concatenate([np.load(root / m.head.files.npy), added])
    index = read_index(root, items)
    index.add(np.ascontiguousarray(added))
    table = pa.concat_tables([old, pa.table(
        {id_column: ids, **{c: new.column(c).cast(old.schema.field(c).type)
                            for c in old.column_names[1:]}})])
    def save_npy(p: Path) -> None:
        with open(p, "wb") as f:
            np.save(f, embeddings)

    # new files under new names, then model.json swapped in one os.replace: a reader sees the
    # old export or the new one, whole, and a crash before the swap leaves the old one intact
    total, superseded = n + count, []
    for owner, attr, write in ((m.head.files, "npy", save_npy),
                               (items, "table", lambda p: pq.write_table(table, p)),
                               (items, "index_file",
                                lambda p: _faiss().write_index(index, str(p)))):
        name = versioned(getattr(owner, attr), total)
        tmp = root / (name + ".adding")
        with writing(tmp):
            write(tmp)
        os.replace(tmp, root / name)
        superseded.append(getattr(owner, attr))
        setattr(owner, attr, name)
    items.num_items = m.head.num_classes = total
    m.head.bytes = embeddings.nbytes
    items.added_items += count
    manifest = write_manifest(m, root / "items")  # items/model.json, then moved into place
    os.replace(manifest, root / "model.json")
    for name in superseded:  # no reader of the new model.json opens them
        (root / name).unlink(missing_ok=True)
    return items
