"""Choices that shape the models (the config schema imports them from here).

No torch import: the config loads these without building anything.
"""

from __future__ import annotations

import enum
from typing import Sequence
from dataclasses import dataclass


class Interaction(enum.Enum):
    """How a DLRM combines its dense and sparse features."""

    DOT = "dot"  # DLRM's pairwise dot products
    DCN = "dcn"  # DCNv2 low-rank cross layers
    FM = "fm"  # DeepFM: the FM pairwise term added to the logit, the MLP over all embeddings


class Pooling(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class HeadKind(enum.Enum):
    """The extreme-classification head (see ``embedtrain.heads.sharded``)."""

    FULL = "full"  # exact softmax, classes split across ranks
    PARTIAL_FC = "partial_fc"  # positives + uniform negatives at sample_rate, per rank
    HARD_NEGATIVES = "hard_negatives"  # positives + nearest classes from a refreshed index
    ADAPTIVE = "adaptive"  # adaptive softmax over frequency-sorted classes (single-label)
    MACH = "mach"  # R hashings of the classes into B buckets, R small heads


class HeadLoss(enum.Enum):
    """The training loss of a sharded head over the classes of a step (all, or the sample)."""

    SOFTMAX = "softmax"  # logsumexp - mean positive logit (one label or several)
    BCE = "bce"  # one-vs-all: sigmoid cross-entropy of every class of the step, summed


class HeadDtype(enum.Enum):
    """How a sharded head stores its class rows (a step computes in float32 either way)."""

    FP32 = "fp32"
    BF16 = "bf16"  # 2 bytes a weight; updates rounded back (see Rounding)
    FP8 = "fp8"    # float8 e4m3 (3 significant bits past the leading one): 1 byte a weight


class Rounding(enum.Enum):
    """How a low-precision head's updated rows are rounded back to their storage dtype."""

    STOCHASTIC = "stochastic"  # up or down with odds of the distance: unbiased
    NEAREST = "nearest"  # round to nearest even: updates smaller than half an ulp are lost


class NegativeIndex(enum.Enum):
    """How hard_negatives finds each example's nearest classes in its snapshot of the weights."""

    EXACT = "exact"  # blocked top-k over every class of the slice
    CLUSTERED = "clustered"  # k-means clusters of the slice; only the nearest clusters searched


class Margin(enum.Enum):
    """Margin on the positives' logits; not ``none``: features and class weights normalised."""

    NONE = "none"
    COSFACE = "cosface"  # s * (cos - m)
    ARCFACE = "arcface"  # s * cos(theta + m)


# the heads sharded over the ranks (each rank a slice of the classes); the others are replicated
SHARDED_HEADS = (HeadKind.FULL, HeadKind.PARTIAL_FC, HeadKind.HARD_NEGATIVES)


def replicated_head_refusal(kind: HeadKind, dtype: HeadDtype, margin: Margin,
                            loss: HeadLoss) -> str | None:
    """Why a replicated head (adaptive, mach) cannot take these settings (``"dtype: bf16 needs
    a full, partial_fc or hard_negatives head, not mach"``), or None: a low-precision dtype, a
    margin and the bce loss are the sharded heads' only. Used by the config loader and
    :func:`~embedtrain.heads.build.build_head`."""
    if kind in SHARDED_HEADS:
        return None
    for name, value, default in (("dtype", dtype, HeadDtype.FP32), ("margin", margin, Margin.NONE),
                                 ("loss", loss, HeadLoss.SOFTMAX)):
        if value is not default:
            return (f"{name}: {value.value} needs a full, partial_fc or hard_negatives head, "
                    f"not {kind.value}")
    return None


class GNNModel(enum.Enum):
    """What :class:`~embedtrain.models.gnn.GraphSAGE` computes from a seed node."""

    SAGE = "sage"  # one SAGEConv per hop over the sampled neighbourhood
    GCN = "gcn"  # one GCNConv per hop: the mean over the node and its neighbours, D^-1 (A + I)
    GAT = "gat"  # one GATConv per hop: attention over the node and its neighbours
    MLP = "mlp"  # the same layers on the node alone: a no-graph baseline
    # the layers on each node alone, then one step of personalised-PageRank propagation a hop:
    # predict, then propagate (Klicpera et al., ICLR 2019)
    APPNP = "appnp"


class SeqModel(enum.Enum):
    """The sequence encoder of ``task: seq`` (see ``embedtrain.models.seq``)."""

    SASREC = "sasrec"  # causal self-attention over the item history (Kang & McAuley 2018)
    HSTU = "hstu"  # pointwise (SiLU, unnormalised) causal attention, gated (Zhai et al. 2024)


class Aggregation(enum.Enum):
    """How a SAGEConv layer pools its neighbours' messages."""

    MEAN = "mean"
    MAX = "max"
    SUM = "sum"


class TableKind(enum.Enum):
    """How an embedding table maps a feature's ids to its rows."""

    STATIC = "static"  # ids are rows: [0, num_embeddings) from the data set's vocabulary or hash
    DYNAMIC = "dynamic"  # raw ids remapped collision-free to rows on the fly, with eviction


class Eviction(enum.Enum):
    """Which ids a full dynamic table gives up for new ones (all counted in training steps)."""

    LRU = "lru"  # the least recently looked up
    LFU = "lfu"  # the least often looked up (counts since admission); new ids must out-count them
    TTL = "ttl"  # LRU, and any id not looked up for ttl_steps is freed even if nothing waits


@dataclass(frozen=True)
class DynamicTable:
    """A dynamic table's size and policy (``tables`` entries of a training config).

    Attributes:
        capacity: rows of the whole table; each of its row-wise shards keeps its last row as
            the default row, which ids without a row (never seen, or evicted) look up.
        eviction: the policy of a full table.
        eviction_interval: steps between admissions: the ids seen in that many steps are
            admitted (and others evicted) together; until then a new id looks up the default
            row. 1: every id has its row in the step it first appears.
        ttl_steps: ``ttl`` only: steps without a lookup after which an id's row is freed.
    """

    capacity: int
    eviction: Eviction = Eviction.LRU
    eviction_interval: int = 1
    ttl_steps: int = 0


def mlp_sizes(embedding_dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int]
              ) -> tuple[list[int], list[int]]:
    """The MLPs' layers with their derived ends: the bottom MLP's output meets the embeddings
    (``embedding_dim``), the top MLP's is the logit (1). Each is appended where the list does
    not end with it already, so a list written with its end means what it always did, and one
    of hidden layers only follows ``embedding_dim`` wherever it is set (a search over it)."""
    bottom = list(bottom_mlp)
    if not bottom or bottom[-1] != embedding_dim:
        bottom.append(embedding_dim)
    top = list(top_mlp)
    if not top or top[-1] != 1:
        top.append(1)
    return bottom, top
