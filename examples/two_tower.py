"""A two-tower CTR model as a user's own recipe, reached from a config without editing embedtrain.

The user tower reads the dense features and the first half of the sparse features, the item tower
the other half; the logit is the dot product of the two towers' outputs. Both towers' layer sizes
are ``model.bottom_mlp``. The tables are the data set's (one per sparse feature), planned, sharded
by TorchRec and trained with the fused sparse optimizer like DLRM's; the loss, metrics, readers,
run directory, ``eval``, ``plan`` and ``export`` are :class:`CTRRecipe`'s.

Run it from the repository root (so that ``examples`` imports, as ``python -m`` would import it):
    embedtrain train examples/two_tower.yaml --out runs/two_tower
    embedtrain eval runs/two_tower
    embedtrain plan examples/two_tower.yaml --cluster configs/clusters/h100-16x8.yaml
    embedtrain export runs/two_tower --out exports/two_tower
"""

from __future__ import annotations

import torch
from torch import nn

from embedtrain.models.dlrm import embedding_bag_collection
from embedtrain.recipes.ctr import CTRRecipe


class Towers(nn.Module):
    """The model after its tables: ``(dense [B, n_dense], pooled [B, F, D]) -> logit [B]``, the
    user tower on the dense features and pooled features ``[0, split)``, the item tower on the
    rest."""

    def __init__(self, split: int, features: int, num_dense: int, dim: int,
                 layers: list[int]) -> None:
        super().__init__()
        self.split = split
        self.user = _tower(num_dense + dim * split, layers)
        self.item = _tower(dim * (features - split), layers)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        user = torch.cat([dense, pooled[:, :self.split].flatten(1)], dim=1)
        item = pooled[:, self.split:].flatten(1)
        return (self.user(user) * self.item(item)).sum(dim=1)


class TwoTower(nn.Module):
    """``(dense [B, n_dense], KeyedJaggedTensor) -> logits [B, 1]``: the tables, then
    :class:`Towers` on their pooled embeddings in the features' order."""

    def __init__(self, tables: nn.Module, features: list[str], towers: Towers) -> None:
        super().__init__()
        self.tables, self.features, self.towers = tables, features, towers

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        pooled = self.tables(sparse).to_dict()  # feature -> [B, D]
        stacked = torch.stack([pooled[f] for f in self.features], dim=1)
        return self.towers(dense, stacked).unsqueeze(1)


def _tower(width: int, layers: list[int]) -> nn.Sequential:
    """Linear layers with ReLU between them; the last one linear (its output is dotted)."""
    modules: list[nn.Module] = []
    for n, size in enumerate(layers):
        modules += [nn.Linear(width, size)] + ([nn.ReLU()] if n < len(layers) - 1 else [])
        width = size
    return nn.Sequential(*modules)


class TwoTowerRecipe(CTRRecipe):
    """``recipe: examples.two_tower:TwoTowerRecipe`` (``task: ctr``): a :class:`TwoTower`."""

    def planning_model(self) -> nn.Module:
        m, features = self.cfg.model, self.dataset.features
        names = [f.name for f in features.sparse]
        tables = embedding_bag_collection(features, m.embedding_dim, torch.device("meta"),
                                          self.feature_dynamic_tables())
        towers = Towers(max(1, len(names) // 2), len(names), len(features.dense),
                        m.embedding_dim, list(m.bottom_mlp))
        return self.fuse_sparse(TwoTower(tables, names, towers))

    def after_lookup(self, model: nn.Module) -> tuple[nn.Module, str]:
        """What export writes as the dense program: the towers (checkpoint keys
        ``model.towers.*``)."""
        return model.towers, "model.towers."
