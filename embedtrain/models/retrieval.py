"""Two-tower retrieval: a query tower and an item tower, scored by a dot product.

Each tower is an MLP over pooled embeddings (TorchRec ``EmbeddingBagCollection`` tables, one per
feature: single ids as they are, lists mean-pooled) and, on the query side, the dense features;
both outputs are L2-normalised, and a score is ``<query, item> / temperature``. The item tower
embeds an item from its row of the item table (:class:`ItemTable`: category, brand, ...) and,
optionally, its own id: without the id, or for an item training never saw (cold), the features
alone place it.

The contract a towers model of one's own keeps (``model: {_component_: ...}`` in a
``task: retrieval`` config; built with ``features``, ``items`` and ``device`` where its signature
takes them): ``forward(dense, sparse, items) -> (queries [B, D] | None, items [n, D] | None)``
(``sparse=None``: no query side; ``items=None``: no item side) and a ``temperature`` attribute.
:class:`RetrievalModel` wraps it with what the family owns: the streaming item frequencies of the
log-q correction and, during an evaluation, the corpus's embeddings.

Example:
    >>> towers = TwoTower(spec, items, dim=64, hidden=[128])
    >>> q, v = towers(dense, kjt, torch.tensor([3, 17]))   # [B, 64], [2, 64], unit rows
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.features import FeatureSpec, SparseFeature
from embedtrain.tables.dynamic import table_name

ITEM_ID = "item_id"  # the item tower's id feature (its table: t_item_id)


@dataclass(frozen=True)
class ItemTable:
    """Every item's categorical features: ``ids[j, f]`` is item ``j``'s id of ``features[f]``."""

    features: tuple[SparseFeature, ...]
    ids: Tensor  # [num_items, len(features)] int64

    @property
    def num_items(self) -> int:
        return self.ids.shape[0]


def mlp(widths: Sequence[int]) -> nn.Sequential:
    """Linear layers through ``widths``, ReLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TowerDense(nn.Module):
    """A tower after its lookups: ``(dense [B, n_dense], pooled [B, tables, D]) -> [B, out]``
    unit rows (the item side has no dense input: ``dense`` is ``[n, 0]``). What export writes as
    a program."""

    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        self.mlp = mlp(widths)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        return F.normalize(self.mlp(torch.cat([dense, pooled.flatten(1)], dim=1)), dim=1)


def _tables(features: Sequence[SparseFeature], dim: int, device: Optional[torch.device]
            ) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=table_name(f.name), embedding_dim=dim,
                           num_embeddings=f.num_embeddings, feature_names=[f.name],
                           pooling=PoolingType.MEAN if f.multi_hot else PoolingType.SUM)
        for f in features], device=device)


class TwoTower(nn.Module):
    """The built-in towers: each an MLP ``[tables x dim (+ dense), *hidden, out_dim]`` over its
    features' pooled embeddings, L2-normalised.

    Args:
        features: the data set's features (the query side's: its sparse and dense columns).
        items: the item table (the item side's features).
        device: where the tables are built (``meta``: the planner sizes them, DMP places them).
        dim: every table's embedding dimension.
        hidden: the towers' hidden widths.
        out_dim: the towers' output width (default ``dim``).
        item_id: the item tower also embeds the item's own id (cold items then get a row
            training never updated; their features still place them).
        temperature: scores are ``<q, v> / temperature`` (the softmax's); with
            ``learn_temperature``, where the temperature starts.
        learn_temperature: the temperature is a weight the dense optimizer trains (its log,
            as CLIP's logit scale), kept at least ``min_temperature``.
        min_temperature: the learned temperature's floor.
        query_features: the sparse features the query tower embeds (default: all of the data
            set's; e.g. leave a user id out where each user has few events).
    """

    def __init__(self, features: FeatureSpec, items: ItemTable,
                 device: Optional[torch.device] = None, dim: int = 64,
                 hidden: Sequence[int] = (128,), out_dim: Optional[int] = None,
                 item_id: bool = True, temperature: float = 0.05,
                 query_features: Optional[Sequence[str]] = None,
                 learn_temperature: bool = False, min_temperature: float = 0.01) -> None:
        super().__init__()
        for key, value in (("temperature", temperature), ("min_temperature", min_temperature)):
            if value <= 0:
                raise ValueError(f"model.{key}: must be positive, got {value}")
        names = [f.name for f in features.sparse]
        unknown = [n for n in query_features or () if n not in names]
        if unknown or (query_features is not None and not query_features):
            raise ValueError(f"model.query_features: {unknown[0] if unknown else '[]'}: not a "
                             f"sparse feature of the data set ({', '.join(names)})")
        sparse = [f for f in features.sparse if query_features is None or f.name in
                  query_features]
        out = out_dim or dim
        self.fixed_temperature = None if learn_temperature else temperature
        self.min_temperature = min_temperature
        self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature))) \
            if learn_temperature else None
        self.query_keys = [f.name for f in sparse]
        self.query_tables = _tables(sparse, dim, device)
        self.query_dense = TowerDense([len(features.dense) + dim * len(sparse), *hidden, out])
        item_features = [SparseFeature(f"item_{f.name}", f.num_embeddings) for f in items.features]
        if item_id:
            item_features.append(SparseFeature(ITEM_ID, items.num_items))
        self.item_keys = [f.name for f in item_features]
        self.item_tables = _tables(item_features, dim, device)
        self.item_dense = TowerDense([dim * len(item_features), *hidden, out])
        self.item_id = item_id
        # the catalogue (data, not weights): rebuilt from the data set, never checkpointed
        self.register_buffer("item_features", items.ids, persistent=False)

    @property
    def temperature(self) -> float | Tensor:
        """The softmax's temperature: the fixed number, or the learned one (a tensor)."""
        if self.log_temperature is None:
            return self.fixed_temperature
        return self.log_temperature.exp().clamp(min=self.min_temperature)

    def forward(self, dense: Optional[Tensor], sparse: Optional[KeyedJaggedTensor],
                items: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """``(queries [B, out_dim], items [n, out_dim])``, unit rows; None for a side not asked."""
        queries = self.query(dense, sparse) if sparse is not None else None
        return queries, (self.item(items) if items is not None else None)

    def query(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        pooled = self.query_tables(sparse).to_dict()
        return self.query_dense(dense, torch.stack([pooled[k] for k in self.query_keys], 1))

    def item_lookup_ids(self, ids: Tensor) -> Tensor:
        """``[n, len(item_keys)]``: the row each item looks up in each item table."""
        feats = self.item_features[ids]
        return torch.cat([feats, ids[:, None]], 1) if self.item_id else feats

    def item(self, ids: Tensor) -> Tensor:
        rows = self.item_lookup_ids(ids)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.item_keys, values=rows.T.reshape(-1),
            lengths=torch.ones(rows.numel(), dtype=torch.int64, device=ids.device))
        pooled = self.item_tables(kjt).to_dict()
        return self.item_dense(rows.new_zeros((len(ids), 0), dtype=torch.float32),
                               torch.stack([pooled[k] for k in self.item_keys], 1))


class ItemFrequency(nn.Module):
    """Streaming estimates of how often each item is a batch's positive (Yi et al., RecSys 2019,
    "Sampling-bias-corrected neural modeling"), for the in-batch softmax's log-q correction.

    Per item: the step it was last seen and ``delta``, a moving average (rate ``alpha``) of the
    steps between its sightings; ``p = 1 / delta`` is its estimated chance of being in a step's
    batch. An item first seen at step ``t`` starts at ``delta = t + 1``. Every rank updates with
    the same (all-gathered) ids, so the estimates agree everywhere; they are checkpointed.
    """

    def __init__(self, num_items: int, alpha: float = 0.01) -> None:
        super().__init__()
        self.alpha = alpha
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("last", torch.full((num_items,), -1, dtype=torch.int64))
        self.register_buffer("delta", torch.ones(num_items, dtype=torch.float32))

    @torch.no_grad()
    def update(self, ids: Tensor) -> None:
        """Counts one step whose positives are ``ids`` (duplicates count once)."""
        t = int(self.step)
        seen = torch.unique(ids)
        last = self.last[seen]
        old = last >= 0
        delta = torch.where(old, (1 - self.alpha) * self.delta[seen]
                            + self.alpha * (t - last).float(),
                            torch.full_like(self.delta[seen], t + 1.0))
        self.delta[seen] = delta
        self.last[seen] = t
        self.step += 1

    def log_p(self, ids: Tensor) -> Tensor:
        """``log p`` of each id (``-log delta``)."""
        return -self.delta[ids].log()


class RetrievalModel(nn.Module):
    """A towers model (:class:`TwoTower` or one's own) with what the retrieval family keeps beside
    it: the item frequencies (``frequency``) and, while evaluating, this rank's slice of the
    corpus's item embeddings (dropped at every ``train()`` / ``eval()``)."""

    def __init__(self, towers: nn.Module, num_items: int, frequency_alpha: float = 0.01) -> None:
        super().__init__()
        self.towers = towers
        self.num_items = num_items
        self.frequency = ItemFrequency(num_items, frequency_alpha)
        self.corpus: Optional[tuple[Tensor, int]] = None

    @property
    def temperature(self) -> float | Tensor:
        """The towers' temperature (a tensor where they learn it: the loss trains it)."""
        return self.towers.temperature

    def forward(self, dense: Optional[Tensor], sparse: Optional[KeyedJaggedTensor],
                items: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
        return self.towers(dense, sparse, items)

    def train(self, mode: bool = True) -> "RetrievalModel":
        self.corpus = None  # the weights may change from here: embed the corpus again
        return super().train(mode)
