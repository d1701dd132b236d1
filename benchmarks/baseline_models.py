"""The baselines of ``bench_baselines.py`` and the embedtrain metrics they are scored with.

Plain torch (and ``torch_geometric`` for the GCN), reading a data set's files as embedtrain
writes them: :class:`FieldFM` (logistic regression, factorization machine) on a tabular CTR set
(:func:`ctr_splits`, :func:`fit_ctr`); :class:`GCN` on a graph set (:func:`load_node_data`,
:func:`fit_gcn`); item kNN on an XC set (:func:`xc_rows`, :func:`tfidf`,
:func:`knn_neighbours`, :func:`knn_topk`). The metrics are embedtrain's own accumulators
(:func:`ctr_auc`, :func:`node_accuracy`, :func:`xc_precision`), so a baseline's figure and a
run's ``summary.json`` mean the same thing.

Example:
    >>> data, rows, slot_field = ctr_splits(Path("data/replicas/ctr"), meta)
    >>> fit_ctr(data, rows, slot_field, rank=0, seed=0, args=args, name="lr")["auc"]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

GCN_EPOCHS = 200
# the CSR matrices of the kNN, and torch_geometric's import: noise in the progress lines
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")


def progress(message: str) -> None:
    """A progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


# --- embedtrain's metrics ------------------------------------------------------------------------

def ctr_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Test AUC as embedtrain's CTR evaluation computes it (``CTRMetrics``, exact AUROC)."""
    from embedtrain.train.ctr import CTRMetrics
    from embedtrain.train.task import StepOutput

    metrics = CTRMetrics()
    p = torch.sigmoid(scores.double())
    metrics.update(StepOutput(loss=torch.zeros(()), predictions=p, num_examples=len(p)),
                   SimpleNamespace(labels=labels.double()))
    return metrics.compute()["auc"]


def node_accuracy(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """Accuracy as embedtrain's node classification computes it (``NodeMetrics``)."""
    from embedtrain.train.gnn import NodeMetrics
    from embedtrain.train.task import StepOutput

    metrics = NodeMetrics(num_classes)
    metrics.update(StepOutput(loss=torch.zeros(()), predictions=logits,
                              num_examples=len(labels)), SimpleNamespace(labels=labels))
    return metrics.compute()["accuracy"]


def xc_precision(top: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...] = (1, 5)
                 ) -> dict[str, float]:
    """``p@k`` as embedtrain's XC evaluation computes it (``XCMetrics``): top-k class ids
    ``[B, max k]`` against targets ``[B]`` or ``[B, L]`` padded with -1."""
    from embedtrain.train.xc_metrics import XCMetrics

    metrics = XCMetrics(ks)
    metrics.update(top, targets)
    return {key: v for key, v in metrics.compute().items() if key.startswith("p@")}


# --- reading a tabular data set ------------------------------------------------------------------

def padded(column: pa.ChunkedArray, width: int, pad: int) -> np.ndarray:
    """A list column (or an int column: one id a row) as ``[N, width]`` int64, padded with
    ``pad``; longer lists keep their first ``width`` ids."""
    array = column.combine_chunks()
    if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
        return array.fill_null(pad).to_numpy(zero_copy_only=False).astype(np.int64)[:, None]
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.flatten().fill_null(pad).to_numpy(zero_copy_only=False).astype(np.int64)
    values = values[offsets[0]:] if len(values) else values
    lengths = np.minimum(np.diff(offsets), width)
    out = np.full((len(lengths), width), pad, np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, cols] = values[np.repeat(offsets[:-1] - offsets[0], lengths) + cols]
    return out


def read_table(root: Path, meta: dict, split: str) -> pa.Table:
    """The split's rows, all its part files."""
    return pa.concat_tables([pq.read_table(root / f) for f in meta["splits"][split]["files"]])


# --- CTR: logistic regression and a factorization machine --------------------------------------

class FieldFM(nn.Module):
    """``b + <w, dense> + sum of the ids' weights`` (rank 0: logistic regression) plus, with
    ``rank > 0``, the pairwise interactions across fields of their rank-``rank`` factors (a
    field's: the sum of its ids'; a dense feature's: its factor times its value).

    Ids are rows of one table for all fields in slots ``[B, S]``, slot ``s`` of field
    ``slot_field[s]``; ``num_ids`` is the padding id (no weight, no factors).
    """

    def __init__(self, num_ids: int, num_dense: int, rank: int, slot_field: torch.Tensor):
        super().__init__()
        self.slot_field = slot_field
        self.num_fields = int(slot_field.max()) + 1
        self.weight = nn.Embedding(num_ids + 1, 1, padding_idx=num_ids)
        self.dense = nn.Linear(num_dense, 1)
        nn.init.zeros_(self.weight.weight)
        self.factors = None
        if rank:
            self.factors = nn.Embedding(num_ids + 1, rank, padding_idx=num_ids)
            self.dense_factors = nn.Parameter(torch.empty(num_dense, rank))
            for w in (self.factors.weight, self.dense_factors):
                nn.init.normal_(w, std=0.01)
            with torch.no_grad():
                self.factors.weight[num_ids].zero_()

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B]`` and the L2 penalty of the looked-up rows (``ids``: ``[B, S]``)."""
        w = self.weight(ids).squeeze(2)
        logit = self.dense(dense).squeeze(1) + w.sum(dim=1)
        penalty = (w * w).sum(dim=1).mean()
        if self.factors is not None:
            v = self.factors(ids)                                           # [B, S, r]
            fields = v.new_zeros(len(v), self.num_fields, v.shape[2]).index_add_(
                1, self.slot_field, v)
            fields = torch.cat([fields, dense[:, :, None] * self.dense_factors], dim=1)
            total = fields.sum(dim=1)
            logit = logit + 0.5 * ((total * total).sum(1) - (fields * fields).sum(dim=(1, 2)))
            penalty = penalty + (v * v).sum(dim=(1, 2)).mean()
        return logit, penalty


def ctr_splits(root: Path, meta: dict, min_count: int = 1
               ) -> tuple[dict[str, tuple[torch.Tensor, ...]], int, torch.Tensor]:
    """Per split ``(dense [N, D] standardised, ids [N, S], labels [N])``, the number of ids (the
    padding id) and each slot's field (a multi-hot field has ``max_length`` slots).

    Ids are renumbered over the (field, id) pairs seen at least ``min_count`` times in the train
    split, so that a table holds only what training can move; every other id (rarer, or absent
    from train) is its field's rare-id row (trained on the rare ids of train; never trained
    with ``min_count`` 1), after them; a null or out-of-range id is an empty slot."""
    sizes = [s["num_embeddings"] for s in meta["sparse"]]
    widths = [s.get("max_length") or 1 if s.get("multi_hot") else 1 for s in meta["sparse"]]
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    num_ids = int(sum(sizes))
    log1p = meta.get("dense_transform") == "log1p"
    raw = {}
    for split in ("train", "valid", "test"):
        t = read_table(root, meta, split)
        dense = np.zeros((t.num_rows, len(meta["dense"])))
        for j, c in enumerate(meta["dense"]):
            dense[:, j] = t[c].fill_null(0).to_numpy(zero_copy_only=False)
        if log1p:
            dense = np.log1p(np.maximum(dense, 0.0))
        ids = np.full((t.num_rows, first[-1]), num_ids, np.int64)
        for f, spec in enumerate(meta["sparse"]):
            col = padded(t[spec["name"]], widths[f], -1)
            ok = (col >= 0) & (col < spec["num_embeddings"])
            ids[:, first[f]:first[f] + col.shape[1]] = np.where(ok, col + base[f], num_ids)
        labels = t[meta["label"]].to_numpy(zero_copy_only=False).astype(np.float32)
        raw[split] = (dense, ids, labels)
    mean, std = raw["train"][0].mean(axis=0), raw["train"][0].std(axis=0)
    std[std == 0] = 1.0
    slot_field = np.repeat(np.arange(len(widths)), widths)
    values, counts = np.unique(raw["train"][1], return_counts=True)
    kept = values[(counts >= min_count) & (values < num_ids)]
    rows = len(kept) + len(widths)        # then the padding id: an empty slot, no weight
    for split, (d, ids, y) in raw.items():
        at = np.minimum(np.searchsorted(kept, ids), max(len(kept) - 1, 0))
        found = kept[at] == ids if len(kept) else np.zeros(ids.shape, bool)
        new = np.where(found, at, len(kept) + slot_field[None, :])   # rare: the field's own
        raw[split] = (d, np.where(ids == num_ids, rows, new), y)
    out = {s: (torch.from_numpy(((d - mean) / std).astype(np.float32)), torch.from_numpy(i),
               torch.from_numpy(y)) for s, (d, i, y) in raw.items()}
    return out, rows, torch.from_numpy(slot_field)


def fit_ctr(data: dict, num_ids: int, slot_field: torch.Tensor, rank: int, seed: int,
            args: argparse.Namespace, name: str, lr: Optional[float] = None) -> dict[str, Any]:
    """Trains a :class:`FieldFM` (Adam at ``lr``, default ``args.lr``; ``args.batch``,
    ``args.l2``, at most ``args.epochs``); the test AUC at the epoch of the best valid AUC."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    dense, ids, labels = data["train"]
    model = FieldFM(num_ids, dense.shape[1], rank, slot_field)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr if lr is None else lr)
    loss_fn = nn.BCEWithLogitsLoss()

    def scores(split: str) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            d, i, _ = data[split]
            return torch.cat([model(d[lo:lo + 65536], i[lo:lo + 65536])[0]
                              for lo in range(0, len(d), 65536)])

    best: Optional[dict[str, Any]] = None
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(labels), generator=gen)
        for lo in range(0, len(order), args.batch):
            idx = order[lo:lo + args.batch]
            logit, penalty = model(dense[idx], ids[idx])
            loss = loss_fn(logit, labels[idx]) + args.l2 * penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
        valid = ctr_auc(scores("valid"), data["valid"][2])
        progress(f"ctr: {name} seed {seed}: epoch {epoch}/{args.epochs}, valid auc {valid:.4f}")
        if best is None or valid > best["valid_auc"]:
            best = {"auc": ctr_auc(scores("test"), data["test"][2]), "valid_auc": valid,
                    "epoch": epoch}
        elif epoch - best["epoch"] >= 2:
            break
    assert best is not None
    return best


# --- node: a full-batch GCN --------------------------------------------------------------------

class GCN(nn.Module):
    """Kipf & Welling's two-layer GCN: dropout, GCNConv, ReLU, dropout, GCNConv.

    The input's dropout draws only its nonzero entries (Kipf's sparse dropout: the same
    distribution as dropping every entry, at the cost of the nonzeros of a bag-of-words
    matrix).
    """

    def __init__(self, features: int, hidden: int, classes: int, dropout: float = 0.5):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1 = GCNConv(features, hidden, cached=True)
        self.conv2 = GCNConv(hidden, classes, cached=True)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor,
                nonzero: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Logits of every node; ``nonzero``: ``x.nonzero(as_tuple=True)``, if known."""
        if self.training and self.dropout:
            at = x.nonzero(as_tuple=True) if nonzero is None else nonzero
            x = torch.zeros_like(x).index_put_(at, nn.functional.dropout(x[at], self.dropout))
        x = torch.relu(self.conv1(x, edge_index))
        x = nn.functional.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


def load_node_data(root: Path) -> SimpleNamespace:
    """The whole graph: row-normalised features, ``edge_index`` (neighbour -> node), labels,
    splits."""
    from embedtrain.graph.store import load_graph

    g = load_graph(root)
    if g.features is None or g.labels is None:
        raise SystemExit(f"{root / 'metadata.json'}: node classification needs node features "
                         f"and labels")
    x = torch.from_numpy(np.array(g.features, dtype=np.float32))
    x = x / x.abs().sum(dim=1, keepdim=True).clamp(min=1e-12)
    rows = np.repeat(np.arange(g.num_nodes, dtype=np.int64), np.diff(np.asarray(g.indptr)))
    edges = torch.from_numpy(np.stack([np.asarray(g.indices, dtype=np.int64), rows]))
    splits = {s: torch.from_numpy(np.array(g.splits[s], dtype=np.int64))
              for s in ("train", "valid", "test")}
    labels = torch.from_numpy(np.array(g.labels, dtype=np.int64))
    return SimpleNamespace(x=x, edge_index=edges, labels=labels, splits=splits,
                           num_classes=int(g.num_classes))


def fit_gcn(data: SimpleNamespace, seed: int, epochs: int = GCN_EPOCHS) -> dict[str, Any]:
    """Trains :class:`GCN`; the test accuracy at the epoch of the best valid accuracy (the
    first such epoch)."""
    torch.manual_seed(seed)
    model = GCN(data.x.shape[1], 64, data.num_classes)
    opt = torch.optim.Adam([{"params": model.conv1.parameters(), "weight_decay": 5e-4},
                            {"params": model.conv2.parameters(), "weight_decay": 0.0}], lr=0.01)
    train, valid, test = (data.splits[s] for s in ("train", "valid", "test"))
    nonzero = data.x.nonzero(as_tuple=True)
    best = {"valid_accuracy": -1.0}
    for epoch in range(1, epochs + 1):
        model.train()
        loss = nn.functional.cross_entropy(model(data.x, data.edge_index, nonzero)[train],
                                           data.labels[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            logits = model(data.x, data.edge_index)
        # plain accuracy for the selection: NodeMetrics' (micro) figure, without its cost
        acc = float((logits[valid].argmax(dim=1) == data.labels[valid]).double().mean())
        if acc > best["valid_accuracy"]:
            best = {"accuracy": node_accuracy(logits[test], data.labels[test],
                                              data.num_classes),
                    "valid_accuracy": acc, "epoch": epoch}
    return best


# --- xc: item kNN ------------------------------------------------------------------------------

def xc_rows(root: Path, meta: dict, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's token bags ``[N, vocab]`` (sparse CSR counts) and targets (``[N]``, or ``[N,
    L]`` padded with -1)."""
    from embedtrain.train.xc_metrics import pad_targets

    t = read_table(root, meta, split)
    spec = meta["sparse"][0]
    tokens = t[spec["name"]].combine_chunks()
    offsets = torch.from_numpy(tokens.offsets.to_numpy().astype(np.int64))
    values = torch.from_numpy(tokens.flatten().to_numpy().astype(np.int64))
    offsets = offsets - offsets[0]
    n = len(offsets) - 1
    row = torch.repeat_interleave(torch.arange(n), offsets.diff())
    bag = torch.sparse_coo_tensor(torch.stack([row, values]), torch.ones(len(values)),
                                  (n, spec["num_embeddings"]), check_invariants=True)
    bag = bag.coalesce().to_sparse_csr()
    label = t[meta["label"]]
    if meta.get("multi_label"):
        targets = pad_targets(label.to_pylist())
    else:
        targets = torch.from_numpy(label.to_numpy().astype(np.int64))
    return bag, targets


def inverse_document_frequency(bag: torch.Tensor) -> torch.Tensor:
    """``log((1 + N) / (1 + df)) + 1`` of every token (``df``: the rows of the sparse CSR
    ``bag [N, V]`` holding it; scikit-learn's smoothed idf)."""
    cols = bag.col_indices()
    df = torch.zeros(bag.shape[1]).index_add_(0, cols, torch.ones(len(cols)))
    return torch.log((1 + bag.shape[0]) / (1 + df)) + 1.0


def tfidf(bag: torch.Tensor, idf: torch.Tensor) -> torch.Tensor:
    """Rows scaled by ``idf`` and to unit L2 norm (sparse CSR in, sparse CSR out)."""
    coo = bag.to_sparse_coo().coalesce()
    r, cols = coo.indices()
    v = coo.values() * idf[cols]
    norm = torch.zeros(bag.shape[0]).index_add_(0, r, v * v).sqrt().clamp(min=1e-12)
    return torch.sparse_coo_tensor(coo.indices(), v / norm[r], bag.shape,
                                   check_invariants=True).to_sparse_csr()


def dense_rows(matrix: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a sparse CSR matrix, dense."""
    crow = matrix.crow_indices()
    start, end = int(crow[lo]), int(crow[hi])
    rows = torch.repeat_interleave(torch.arange(hi - lo), crow[lo + 1:hi + 1] - crow[lo:hi])
    out = torch.zeros(hi - lo, matrix.shape[1], dtype=matrix.dtype)
    return out.index_put_((rows, matrix.col_indices()[start:end]), matrix.values()[start:end])


def knn_neighbours(train: torch.Tensor, query: torch.Tensor, k: int, block: int = 512
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most similar train rows of every query row (cosine of unit rows; ties: the
    smaller train row first): ``(similarities [Q, k], train rows [Q, k])``."""
    sims, rows = [], []
    for lo in range(0, query.shape[0], block):
        q = dense_rows(query, lo, min(lo + block, query.shape[0]))          # [B, V]
        s = (train @ q.T).T                                                  # [B, N_train]
        # exact ties by the row id: a stable sort of the negated scores
        order = torch.sort(-s, dim=1, stable=True).indices[:, :k]
        sims.append(torch.gather(s, 1, order))
        rows.append(order)
    return torch.cat(sims), torch.cat(rows)


def knn_topk(sims: torch.Tensor, rows: torch.Tensor, train_targets: torch.Tensor,
             popularity: np.ndarray, k: int, top: int = 5) -> torch.Tensor:
    """The top-``top`` classes of every row by the similarity-weighted votes of its first ``k``
    neighbours' labels; ties (and rows with fewer voted classes) by train frequency, then id."""
    labels = train_targets.view(len(train_targets), -1)
    filler = np.lexsort((np.arange(len(popularity)), -popularity))[:top]
    out = np.empty((len(rows), top), np.int64)
    for r in range(len(rows)):
        votes: dict[int, float] = {}
        for sim, row in zip(sims[r, :k].tolist(), rows[r, :k].tolist()):
            for c in labels[row].tolist():
                if c >= 0 and sim > 0:
                    votes[c] = votes.get(c, 0.0) + sim
        ranked = sorted(votes, key=lambda c: (-votes[c], -popularity[c], c))[:top]
        ranked += [int(c) for c in filler if c not in votes][:top - len(ranked)]
        out[r] = ranked
    return torch.from_numpy(out)
