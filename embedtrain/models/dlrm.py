"""DLRM and DCNv2 CTR models built from a :class:`~embedtrain.features.FeatureSpec`.

The models are TorchRec's own (``torchrec.models.dlrm.DLRM`` / ``DLRM_DCN``: sparse arch, dense
arch, interaction, over arch), fed by one ``EmbeddingBagCollection`` table per sparse feature. Build
on ``torch.device("meta")`` to plan or shard without allocating the tables.

Example:
    >>> spec = FeatureSpec(label="y", dense=("d0",), sparse=(SparseFeature("c0", 100),))
    >>> model = dlrm(spec, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
    >>> logits = model(dense_features, sparse_features)   # [B, 1]
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.mlp import Perceptron
from torchrec.modules.embedding_configs import PoolingType

from embedtrain.features import FeatureSpec
from embedtrain.models.dynamic import feature_tables
from embedtrain.models.options import DynamicTable


def embedding_bag_collection(
    spec: FeatureSpec, embedding_dim: int, device: Optional[torch.device] = None,
    dynamic: Optional[Mapping[str, DynamicTable]] = None,
) -> nn.Module:
    """One table per sparse feature (``t_<name>``), sized by its vocabulary; lists are sum-pooled.

    Args:
        spec: the feature spec.
        embedding_dim: dimension of every table (DLRM's dot interaction needs one size).
        device: ``meta`` to build without memory, ``None`` for CPU.
        dynamic: tables (by name) that remap raw ids collision-free, with their capacity and
            eviction (:mod:`embedtrain.models.dynamic`).

    Returns:
        The (unsharded) embedding bag collection, or :class:`~embedtrain.models.dynamic.
        EmbeddingBags` when some tables are dynamic.
    """
    return feature_tables(spec.sparse, embedding_dim, PoolingType.SUM, dynamic, device)


def dlrm(
    spec: FeatureSpec,
    embedding_dim: int,
    bottom_mlp: Sequence[int],
    top_mlp: Sequence[int],
    device: Optional[torch.device] = None,
    dropout: float = 0.0,
    dynamic: Optional[Mapping[str, DynamicTable]] = None,
) -> nn.Module:
    """DLRM with dot-product interaction.

    Args:
        spec: the feature spec (dense columns feed the bottom MLP, sparse ones the tables).
        embedding_dim: table dimension; must equal ``bottom_mlp[-1]``.
        bottom_mlp: layer sizes of the dense arch.
        top_mlp: layer sizes of the over arch; the last must be 1 (the logit).
        device: device of the embedding tables (``meta`` for planning).
        dropout: probability of dropping each hidden unit of the bottom and top MLPs in
            training (after each layer's activation; not after the bottom MLP's output or the
            logit); 0: none.
        dynamic: the dynamic tables by name (see :func:`embedding_bag_collection`).

    Returns:
        A module ``(dense [B, n_dense], KeyedJaggedTensor) -> logits [B, 1]``.
    """
    _check_sizes(embedding_dim, bottom_mlp, top_mlp)
    model = DLRM(
        embedding_bag_collection=embedding_bag_collection(spec, embedding_dim, device, dynamic),
        dense_in_features=len(spec.dense),
        dense_arch_layer_sizes=list(bottom_mlp),
        over_arch_layer_sizes=list(top_mlp),
    )
    return add_dropout(model, dropout)


def dcn(
    spec: FeatureSpec,
    embedding_dim: int,
    bottom_mlp: Sequence[int],
    top_mlp: Sequence[int],
    num_layers: int = 3,
    low_rank_dim: int = 64,
    device: Optional[torch.device] = None,
    dropout: float = 0.0,
    dynamic: Optional[Mapping[str, DynamicTable]] = None,
) -> nn.Module:
    """DLRM with DCNv2 low-rank cross layers as the interaction (see :func:`dlrm` for the args).

    Args:
        num_layers: cross layers.
        low_rank_dim: rank of each cross layer's weight.
    """
    _check_sizes(embedding_dim, bottom_mlp, top_mlp)
    model = DLRM_DCN(
        embedding_bag_collection=embedding_bag_collection(spec, embedding_dim, device, dynamic),
        dense_in_features=len(spec.dense),
        dense_arch_layer_sizes=list(bottom_mlp),
        over_arch_layer_sizes=list(top_mlp),
        dcn_num_layers=num_layers,
        dcn_low_rank_dim=low_rank_dim,
    )
    return add_dropout(model, dropout)


class _ActivationDropout(nn.Module):
    """A perceptron's activation followed by dropout (no parameters: state dicts unchanged)."""

    def __init__(self, activation, p: float) -> None:
        super().__init__()
        self.activation, self.dropout = activation, nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.activation(x))


def add_dropout(model: nn.Module, p: float) -> nn.Module:
    """Dropout ``p`` after the activation of every hidden layer of a TorchRec DLRM's MLPs.

    Hidden layers: every perceptron of the over arch's MLP (its final linear layer, the logit,
    has none) and every one of the dense arch but its last (its output joins the embeddings).
    Parameter names do not change, so checkpoints load with or without dropout. ``p == 0``
    leaves the model as it is.
    """
    if not 0 <= p < 1:
        raise ValueError(f"model.dropout: must be in [0, 1), got {p}")
    if p == 0:
        return model
    bottom = list(model.dense_arch.model._mlp)[:-1]
    top = [m for m in model.over_arch.model.modules() if isinstance(m, Perceptron)]
    for perceptron in bottom + top:
        perceptron._activation_fn = _ActivationDropout(perceptron._activation_fn, p)
    return model


def _check_sizes(embedding_dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int]) -> None:
    if not bottom_mlp or bottom_mlp[-1] != embedding_dim:
        raise ValueError(
            f"model.bottom_mlp must end with embedding_dim={embedding_dim}, got {list(bottom_mlp)}"
        )
    if not top_mlp or top_mlp[-1] != 1:
        raise ValueError(f"model.top_mlp must end with 1 (the logit), got {list(top_mlp)}")
