"""DLRM, DCNv2 and DeepFM CTR models built from a :class:`~embedtrain.features.FeatureSpec`.

The models are TorchRec's DLRM (``torchrec.models.dlrm``: sparse arch, dense arch, interaction,
over arch) with DCNv2's cross layers or DeepFM's factorization-machine term as the interaction
(:class:`CTRModel`), fed by one ``EmbeddingBagCollection`` table per sparse feature, optionally a
first-order (wide) table per feature and an L2 penalty on the looked-up embeddings. Build on
``torch.device("meta")`` to plan or shard without allocating the tables.

Example:
    >>> spec = FeatureSpec(label="y", dense=("d0",), sparse=(SparseFeature("c0", 100),))
    >>> model = dlrm(spec, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
    >>> logits = model(dense_features, sparse_features)   # [B, 1]
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import Perceptron
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.features import FeatureSpec
from embedtrain.tables.dynamic import feature_tables
from embedtrain.models.options import DynamicTable, Interaction, mlp_sizes


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
            eviction (:mod:`embedtrain.tables.dynamic`).

    Returns:
        The (unsharded) embedding bag collection, or :class:`~embedtrain.tables.dynamic.
        EmbeddingBags` when some tables are dynamic.
    """
    return feature_tables(spec.sparse, embedding_dim, PoolingType.SUM, dynamic, device)


def dlrm(spec: FeatureSpec, embedding_dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int],
         **options: Any) -> "CTRModel":
    """DLRM with dot-product interaction: :func:`ctr_model` with ``Interaction.DOT``."""
    return ctr_model(spec, Interaction.DOT, embedding_dim, bottom_mlp, top_mlp, **options)


def dcn(spec: FeatureSpec, embedding_dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int],
        num_layers: int = 3, low_rank_dim: int = 64, **options: Any) -> "CTRModel":
    """DLRM with DCNv2 low-rank cross layers as the interaction (``num_layers`` of rank
    ``low_rank_dim``): :func:`ctr_model` with ``Interaction.DCN``."""
    return ctr_model(spec, Interaction.DCN, embedding_dim, bottom_mlp, top_mlp, num_layers,
                     low_rank_dim, **options)


def deepfm(spec: FeatureSpec, embedding_dim: int, bottom_mlp: Sequence[int],
           top_mlp: Sequence[int], linear: bool = True, **options: Any) -> "CTRModel":
    """DeepFM (Guo et al., 2017) in DLRM's frame: the first-order term, the factorization
    machine's pairwise term over the embeddings and the top MLP over all of them, summed into the
    logit (:func:`ctr_model` with ``Interaction.FM``; ``linear=False`` leaves the first-order
    term out)."""
    return ctr_model(spec, Interaction.FM, embedding_dim, bottom_mlp, top_mlp, linear=linear,
                     **options)


def ctr_model(
    spec: FeatureSpec,
    interaction: Interaction,
    embedding_dim: int,
    bottom_mlp: Sequence[int],
    top_mlp: Sequence[int],
    dcn_num_layers: int = 3,
    dcn_low_rank_dim: int = 64,
    device: Optional[torch.device] = None,
    dropout: float = 0.0,
    dynamic: Optional[Mapping[str, DynamicTable]] = None,
    linear: bool = False,
    embedding_l2: float = 0.0,
) -> "CTRModel":
    """The CTR model of ``interaction``: ``dot`` DLRM, ``dcn`` DCNv2, ``fm`` DeepFM.

    Args:
        spec: the feature spec (dense columns feed the bottom MLP, sparse ones the tables).
        interaction: how the bottom MLP's output and the pooled embeddings meet.
        embedding_dim: table dimension; the bottom MLP's output (appended to ``bottom_mlp``
            unless it ends with it, :func:`mlp_sizes`).
        bottom_mlp: layer sizes of the dense arch.
        top_mlp: layer sizes of the over arch; its last, 1 (the logit), appended if missing.
        dcn_num_layers, dcn_low_rank_dim: DCNv2's cross layers and the rank of their weights.
        device: device of the embedding tables (``meta`` for planning).
        dropout: probability of dropping each hidden unit of the bottom and top MLPs in
            training (after each layer's activation; not after the bottom MLP's output or the
            logit); 0: none.
        dynamic: the dynamic tables by name (see :func:`embedding_bag_collection`).
        linear: add the first-order term (:class:`LinearArch`) to the logit.
        embedding_l2: the L2 penalty of the looked-up embeddings (:class:`CTRModel`).

    Returns:
        A :class:`CTRModel` ``(dense [B, n_dense], KeyedJaggedTensor) -> logits [B, 1]``.

    Raises:
        ValueError: layer sizes that do not fit, a negative ``embedding_l2``, or ``linear``
            with dynamic tables.
    """
    bottom_mlp, top_mlp = mlp_sizes(embedding_dim, bottom_mlp, top_mlp)
    if embedding_l2 < 0:
        raise ValueError(f"optim.embedding_l2: must be >= 0, got {embedding_l2}")
    linear_tables = None
    if linear:
        if dynamic:
            raise ValueError(
                f"model.linear: not with dynamic tables ({', '.join(sorted(dynamic))}) yet: the "
                f"first-order tables would need their own id remapping; set model.linear: false")
        linear_tables = linear_collection(spec, device)
    model = CTRModel(
        embedding_bag_collection(spec, embedding_dim, device, dynamic), len(spec.dense),
        bottom_mlp, top_mlp, interaction, dcn_num_layers, dcn_low_rank_dim, linear_tables,
        embedding_l2)
    return add_dropout(model, dropout)


# FBGEMM's table-batched kernels (and TorchRec's fused sharding) need a table dimension that is
# a multiple of 4 (torchrec issue #1495): a first-order table is 4 wide and reads column 0.
LINEAR_DIM = 4


def linear_table_name(feature: str) -> str:
    """The first-order (wide) table of sparse feature ``feature``."""
    return f"l_{feature}"


def linear_collection(spec: FeatureSpec, device: Optional[torch.device] = None
                      ) -> EmbeddingBagCollection:
    """One first-order table ``l_<feature>`` per sparse feature, :data:`LINEAR_DIM` wide,
    initialised to zero (an untrained id adds nothing to the logit); lists are sum-pooled."""
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=linear_table_name(f.name), embedding_dim=LINEAR_DIM,
                           num_embeddings=f.num_embeddings, feature_names=[f.name],
                           pooling=PoolingType.SUM, weight_init_min=0.0, weight_init_max=0.0)
        for f in spec.sparse], device=device)


class LinearArch(nn.Module):
    """The first-order term: each feature's pooled weight (column 0 of its ``l_`` table),
    ``KeyedJaggedTensor -> [B, F]``; their sum is what the model adds to the logit."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        self._feature_names = [name for c in embedding_bag_collection.embedding_bag_configs()
                               for name in c.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.stack([pooled[name][:, 0] for name in self._feature_names], dim=1)


class FMInteractionArch(nn.Module):
    """DeepFM's interaction over the bottom MLP's output and the F pooled embeddings (F + 1
    vectors ``v_i``): their concatenation, for the top MLP, and, as one more column, the
    factorization machine's pairwise term ``sum_{i<j} <v_i, v_j>``, computed in O(F D) as
    ``((sum_i v_i)^2 - sum_i v_i^2) / 2`` summed over the D dimensions (Rendle, 2010).
    ``(dense [B, D], sparse [B, F, D]) -> [B, (F + 1) D + 1]``."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F = num_sparse_features

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor
                ) -> torch.Tensor:
        v = torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)
        pairwise = 0.5 * (v.sum(dim=1).square() - v.square().sum(dim=1)).sum(dim=1, keepdim=True)
        return torch.cat([v.flatten(1), pairwise], dim=1)


class DeepFMOverArch(OverArch):
    """TorchRec's over arch on all but the last column, that column (the FM term) added to its
    logit: ``[B, n + 1] -> [B, 1]``."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features[:, :-1]) + features[:, -1:]


class CTRModel(DLRM):
    """TorchRec's DLRM with the interaction of ``interaction`` (DCNv2's as in ``DLRM_DCN``;
    DeepFM's :class:`FMInteractionArch` and :class:`DeepFMOverArch`), an optional first-order
    term and an L2 penalty on the looked-up embeddings. Parameter names are DLRM's
    (``sparse_arch``, ``dense_arch``, ``inter_arch``, ``over_arch``, and ``linear_arch`` for the
    first-order tables), so a checkpoint of TorchRec's DLRM or DLRM_DCN loads into it.

    The penalty (``embedding_l2`` = lambda > 0, in training only): lambda times the mean over
    the batch's rows of the squared norms of their pooled embeddings (and first-order weights),
    ``lambda / B * sum_b sum_f ||pooled[b, f]||^2``. It is kept in :attr:`penalty` after each
    training forward, and the task adds it to the loss (:func:`embedding_penalty`), so its
    gradient reaches the rows through the tables' own backward: any kernel, any fused
    optimizer, any sharding. Pooled, not per id: the pooled embeddings are what the forward
    already holds (no extra lookup), and for a one-id feature they are the row itself, so the
    gradient of a row is ``2 lambda / B`` times the row for each time the batch looks it up --
    the per-occurrence regularisation of an FM trained by SGD (Rendle, 2012); a multi-id bag's
    penalty is on its sum. Rows the batch does not look up are untouched (FBGEMM's kernels
    ignore ``weight_decay``, which would decay every row).
    """

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 bottom_mlp: Sequence[int], top_mlp: Sequence[int],
                 interaction: Interaction = Interaction.DOT, dcn_num_layers: int = 3,
                 dcn_low_rank_dim: int = 64,
                 linear_tables: Optional[EmbeddingBagCollection] = None,
                 embedding_l2: float = 0.0) -> None:
        super().__init__(embedding_bag_collection, dense_in_features, list(bottom_mlp),
                         list(top_mlp))
        F, D = len(self.sparse_arch.sparse_feature_names), bottom_mlp[-1]
        self.interaction = interaction
        if interaction is Interaction.DCN:
            self.inter_arch = InteractionDCNArch(F, LowRankCrossNet(
                in_features=(F + 1) * D, num_layers=dcn_num_layers, low_rank=dcn_low_rank_dim))
            self.over_arch = OverArch((F + 1) * D, list(top_mlp))
        elif interaction is Interaction.FM:
            self.inter_arch = FMInteractionArch(F)
            self.over_arch = DeepFMOverArch((F + 1) * D, list(top_mlp))
        self.linear_arch = LinearArch(linear_tables) if linear_tables is not None else None
        self.embedding_l2 = float(embedding_l2)
        self.penalty: Optional[torch.Tensor] = None

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
                ) -> torch.Tensor:
        pooled = self.sparse_arch(sparse_features)
        logits = self.over_arch(self.inter_arch(dense_features=self.dense_arch(dense_features),
                                                sparse_features=pooled))
        weights = None
        if self.linear_arch is not None:
            weights = self.linear_arch(sparse_features)
            logits = logits + weights.sum(dim=1, keepdim=True)
        if self.training and self.embedding_l2 > 0:
            squares = pooled.square().sum()
            if weights is not None:
                squares = squares + weights.square().sum()
            self.penalty = self.embedding_l2 * squares / pooled.shape[0]
        return logits


def embedding_penalty(model: object) -> Optional[torch.Tensor]:
    """The L2 penalty of ``model``'s last training forward (:class:`CTRModel`), taken: None
    when it has none. ``model`` may be wrapped (``DistributedModelParallel``, DDP, the train
    pipeline's stand-in): wrappers are followed through their ``module``."""
    for _ in range(8):
        if isinstance(model, CTRModel):
            penalty, model.penalty = model.penalty, None
            return penalty
        model = getattr(model, "module", None)
        if model is None:
            return None
    return None


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
