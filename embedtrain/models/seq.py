"""Sequential recommendation: a causal encoder over a user's item history and a class head over
every item (``task: seq``).

:class:`SeqEncoder` is SASRec (Kang & McAuley, ICDM 2018): the history's item embeddings, from a
TorchRec ``EmbeddingCollection`` (one row per item, a per-position lookup of the jagged
histories, planned and sharded like every table), scaled by ``sqrt(D)``, plus learned recency
positions (position 0 is the newest item, as SASRec's left-padded windows number them), then
pre-norm self-attention blocks with a causal mask: position ``i`` attends to positions ``<= i``
only, never to a later item. The histories are padded on the right to ``max_length`` (the
batch's rows stay in one ``[B, T, D]`` tensor of fixed shape): a padded position lies after every
real one, so the causal mask alone keeps it out of the real positions' attention. With
``model="hstu"`` the blocks are :class:`HSTUBlock`'s (Zhai et al., ICML 2024: pointwise SiLU
attention, gated), the rest the same.

:class:`SeqModel` puts one of :mod:`embedtrain.heads.sharded`'s heads (or a replicated one)
over the item corpus. Training predicts the next item at every position: position ``i`` of a row
``(items, target)`` predicts ``items[i + 1]``, the last position predicts ``target``; the
positions are the head's examples (``B x T`` of them, padded positions labelled ``-1``, which
every head leaves out of its loss), so each rank hands the head the same number of rows.
Evaluation scores the last position of each history against the whole corpus: the head's loss,
top-k item ids, and (sharded heads) the target's rank among every item, for MRR; the padding id
0, which is no item, is never ranked. With ``exclude_history`` the history's items are taken out
of the ranking too (the top ``k + 1 + max_length`` items with the excluded ones removed, and ranks
among the other items); a target that is in its own
history is then a miss (rank 0: no reciprocal rank), as a served model that never recommends a
seen item would miss it.

Example:
    >>> head = build_head(HeadKind.PARTIAL_FC, num_items, 64, sample_rate=0.1, group=group)
    >>> model = SeqModel(num_items, 64, max_length=50, layers=2, heads=2, dropout=0.2, head=head)
    >>> loss = model(dense, kjt, targets)                       # training: every position
    >>> losses, top = model.eval()(dense, kjt, targets, 10)     # evaluation: the last position
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.models.options import HeadDtype
from embedtrain.models.options import SeqModel as Encoder
from embedtrain.heads.build import planning_head

ITEM_TABLE = "t_items"  # the item table's name in plans and checkpoints


class HSTUBlock(nn.Module):
    """One HSTU layer (Zhai et al., "Actions Speak Louder than Words", ICML 2024), pre-norm:
    ``U, V, Q, K = SiLU(W x)``; per head ``A = SiLU(Q K^T + rab(i - j)) / T`` on ``j <= i``
    (pointwise attention: no softmax over the positions, so what the history holds is summed,
    not averaged); ``y = x + W_o Dropout(LayerNorm(Dropout_a(A) V) * U)``. ``rab`` is a learned
    bias per head and relative offset; ``attention_dropout`` drops attention weights."""

    def __init__(self, dim: int, heads: int, dropout: float, max_length: int,
                 device: Optional[torch.device] = None, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.max_length = heads, max_length
        self.attention_dropout = attention_dropout
        self.norm = nn.LayerNorm(dim, device=device)
        self.uvqk = nn.Linear(dim, 4 * dim, device=device)
        self.attn_norm = nn.LayerNorm(dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.rab = nn.Parameter(torch.zeros(heads, max_length, device=device))  # offset i - j
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, offset: Tensor) -> Tensor:
        """``x`` [B, T, D]; ``offset`` [T, T] the causal offsets ``i - j`` (negative: a later
        position, never attended)."""
        b, t, d = x.shape
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).chunk(4, dim=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        bias = self.rab[:, offset.clamp(min=0)]              # [H, T, T]
        scores = q @ k.transpose(-1, -2)
        scores += bias  # in place: [B, H, T, T] is the block's largest tensor
        # the causal mask and the 1/T scale in one multiplication
        a = F.silu(scores) * ((offset >= 0).to(scores.dtype) / self.max_length)
        a = F.dropout(a, self.attention_dropout, self.training)
        y = (a @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.out(self.dropout(self.attn_norm(y) * u))


class HSTUStack(nn.Module):
    """HSTU blocks, called as ``nn.TransformerEncoder`` is in :func:`encode` (always causal)."""

    def __init__(self, dim: int, heads: int, dropout: float, max_length: int, layers: int,
                 device: Optional[torch.device] = None, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HSTUBlock(dim, heads, dropout, max_length, device,
                                              attention_dropout) for _ in range(layers))

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, is_causal: bool = True) -> Tensor:
        del mask, is_causal  # each block masks the later positions by their offsets
        t = x.shape[1]
        offset = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        for layer in self.layers:
            x = layer(x, offset)
        return x


def padded_positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``(row, position)`` of every element of jagged rows of ``lengths``, in order."""
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(rows.numel()) - starts[rows]


class SeqEncoder(nn.Module):
    """Item histories (a jagged feature of a KJT) -> ``([B, T, D]`` per-position features,
    ``[B]`` history lengths``)``; ``T = max_length``.

    Args:
        num_items: rows of the item table (ids ``0..num_items-1``; 0 is padding, never looked up
            in a history).
        dim: the table's and the encoder's width D.
        max_length: the longest history T (positions ``0..T-1``).
        layers, heads, dropout: the self-attention blocks (D divisible by ``heads``), and the
            dropout on the inputs and inside the blocks.
        attention_dropout: dropout on the attention weights (SASRec's original drops them at
            ``dropout``; off, training takes torch's fused causal attention: 2.1x faster blocks
            at 256 x 200 x 64 on 2 CPU cores).
        feature: the KJT key of the histories.
        model: ``sasrec`` (softmax self-attention blocks) or ``hstu`` (:class:`HSTUBlock`).
        blocks: a module of one's own instead (``layers``, ``heads`` and ``model`` then unused):
            ``blocks(x [B, T, D], mask, is_causal=True) -> [B, T, D]``, position ``t``'s output
            from positions ``<= t`` only (every position is trained on its next item).
        device: the item table's device (``meta``: materialised by the sharding wrapper). The
            attention blocks are built on CPU when it is ``meta``: the wrapper materialises a
            meta module with its ``reset_parameters``, which ``nn.MultiheadAttention`` lacks
            (its projections would stay uninitialised memory).
    """

    def __init__(self, num_items: int, dim: int, max_length: int, layers: int = 2,
                 heads: int = 2, dropout: float = 0.2, feature: str = "items",
                 device: Optional[torch.device] = None, model: str = "sasrec",
                 blocks: Optional[nn.Module] = None, attention_dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads and blocks is None:
            raise ValueError(f"seq.dim: {dim} is not divisible by seq.heads ({heads})")
        self.feature, self.dim, self.max_length = feature, dim, max_length
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name=ITEM_TABLE, embedding_dim=dim, num_embeddings=num_items,
            feature_names=[feature])], device=device)
        dense = None if device is not None and torch.device(device).type == "meta" else device
        self.positions = nn.Embedding(max_length, dim, device=dense)
        if blocks is not None:
            self.blocks = blocks
        elif Encoder(model) is Encoder.HSTU:  # an unknown name: ValueError
            self.blocks = HSTUStack(dim, heads, dropout, max_length, layers, dense,
                                    attention_dropout)
        else:
            block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=dim, dropout=dropout,
                                               batch_first=True, norm_first=True, device=dense)
            block.self_attn.dropout = attention_dropout  # the rest of the block's: ``dropout``
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim, device=dense)
        self.dropout = nn.Dropout(dropout)

    def forward(self, sparse: KeyedJaggedTensor) -> tuple[Tensor, Tensor]:
        jt = self.ec(sparse)[self.feature]
        lengths = jt.lengths().long()
        if lengths.numel() and int(lengths.max()) > self.max_length:
            raise ValueError(f"a history of {int(lengths.max())} items is longer than the "
                             f"encoder's max_length {self.max_length}")
        return encode(self, pad_history(jt.values(), lengths, self.max_length), lengths), lengths


def history_ids(values: Tensor, lengths: Tensor, max_length: int) -> Tensor:
    """Jagged histories' item ids -> ``[B, max_length]``, ``-1`` past each end."""
    rows, pos = padded_positions(lengths.long())
    out = torch.full((lengths.numel(), max_length), -1, dtype=torch.long)
    out[rows, pos] = values.long()
    return out


def excluded_items(values: Tensor, lengths: Tensor, max_length: int, history: bool) -> Tensor:
    """The items a ranking leaves out, ``[B, 1]`` or ``[B, 1 + max_length]`` (``-1``: none):
    the padding id 0, which is no item, and with ``history`` each row's history."""
    pad = torch.zeros((lengths.numel(), 1), dtype=torch.long)
    if not history:
        return pad
    return torch.cat([pad, history_ids(values, lengths, max_length)], dim=1)


def pad_history(values: Tensor, lengths: Tensor, max_length: int) -> Tensor:
    """Jagged per-item rows ``[N, D]`` of histories of ``lengths`` -> ``[B, max_length, D]``,
    zeros past each history's end."""
    rows, pos = padded_positions(lengths)
    x = values.new_zeros((lengths.numel(), max_length, values.shape[-1]))
    return x.index_put((rows, pos), values)


def encode(m: nn.Module, history: Tensor, lengths: Tensor) -> Tensor:
    """The SASRec blocks of ``m`` (a :class:`SeqEncoder` or :class:`SeqDense`: its
    ``positions``, ``blocks``, ``norm``, ``dropout``) over padded item embeddings
    ``[B, T, D]`` (zeros past each of ``lengths``) -> ``[B, T, D]``."""
    t, d = history.shape[1], history.shape[2]
    # recency: the newest item of a history is position 0, as in SASRec's padded windows
    recency = (lengths[:, None] - 1 - torch.arange(t)).clamp(min=0)
    x = m.dropout(history * math.sqrt(d) + m.positions(recency))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype)
    return m.norm(m.blocks(x, mask=causal, is_causal=True))


class SeqDense(nn.Module):
    """The encoder without its item table, as ``embedtrain export`` writes it:
    ``(dense [B, 0], history [B, T, D], lengths [B]) -> [B, D]``, the last position's features
    (what evaluation scores), from the padded item embeddings of the histories (the exported
    table's rows, zeros past each end). Shares ``encoder``'s parameters (same names)."""

    def __init__(self, encoder: SeqEncoder) -> None:
        super().__init__()
        self.positions, self.blocks = encoder.positions, encoder.blocks
        self.norm, self.dropout = encoder.norm, encoder.dropout

    def forward(self, dense: Tensor, history: Tensor, lengths: Tensor) -> Tensor:
        del dense  # the rows' dense columns: a sequence data set has none
        h = encode(self, history, lengths)
        return h[torch.arange(h.shape[0]), (lengths - 1).clamp(min=0)]


def first_k_outside(scores: Tensor, ids: Tensor, seen: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first ``k`` of ranked ``(scores, ids)`` ``[B, n]`` whose id is not in the row's
    ``seen`` ``[B, T]`` (``-1``: none), in their order (``n >= k + T``: enough remain)."""
    hidden = (ids[:, :, None] == seen[:, None, :]).any(-1)
    order = torch.sort(hidden.to(torch.int8), dim=1, stable=True).indices[:, :k]
    return scores.gather(1, order), ids.gather(1, order)


class SeqModel(nn.Module):
    """Sequence encoder + a head over the item corpus; ``forward``: the loss (training: every
    position) or ``(losses, top-k ids, target ranks)`` of the last position (evaluation; the
    ranks None for a head without ``target_rank``: the replicated ones).

    Args:
        num_items: the item corpus (the head's classes and the table's rows).
        dim, max_length, layers, heads, dropout, attention_dropout: :class:`SeqEncoder`'s.
        head: the head (:func:`embedtrain.heads.build.build_head` with ``dim``); ``None`` builds
            the planning placeholder (a row-wise table the planner can size).
        feature: the histories' KJT key.
        device: the encoder's device.
        head_dtype: the planning placeholder's storage.
        exclude_history: evaluation ranks only items outside the example's history.
        model, blocks: the encoder's blocks, ``sasrec`` or ``hstu``, or one's own module
            (:class:`SeqEncoder`).
    """

    def __init__(self, num_items: int, dim: int, max_length: int, layers: int, heads: int,
                 dropout: float, head: Optional[nn.Module], feature: str = "items",
                 device: Optional[torch.device] = None,
                 head_dtype: HeadDtype = HeadDtype.FP32, exclude_history: bool = False,
                 model: str = "sasrec", blocks: Optional[nn.Module] = None,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.exclude_history = exclude_history
        self.encoder = SeqEncoder(num_items, dim, max_length, layers, heads, dropout, feature,
                                  device, model, blocks, attention_dropout)
        self.head = head if head is not None else planning_head(num_items, dim, head_dtype,
                                                                device)

    def next_items(self, sparse: KeyedJaggedTensor, targets: Tensor) -> Tensor:
        """``[B, T]``: the item each position predicts (``items[i + 1]``, then ``target`` at the
        last position); ``-1`` past the history and in rows without a target (padding)."""
        jt = sparse[self.encoder.feature]
        lengths = jt.lengths().long()
        rows, pos = padded_positions(lengths)
        out = torch.full((lengths.numel(), self.encoder.max_length), -1, dtype=torch.long)
        following = pos > 0  # element i of a history is the item position i - 1 predicts
        out[rows[following], pos[following] - 1] = jt.values().long()[following]
        has = (lengths > 0) & (targets >= 0)
        out[has.nonzero(as_tuple=True)[0], lengths[has] - 1] = targets[has].long()
        out[~has] = -1
        return out

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor, targets: Tensor, k: int = 0):
        h, lengths = self.encoder(sparse)
        if self.training:
            nxt = self.next_items(sparse, targets)
            return self.head(h.reshape(-1, h.shape[-1]), nxt.reshape(-1))
        last = h[torch.arange(h.shape[0]), (lengths - 1).clamp(min=0)]
        targets = targets.clamp(min=0)  # padding rows: item 0's figures, dropped by the task
        losses = self.head.eval_loss(last, targets)
        jt = sparse[self.encoder.feature]
        seen = excluded_items(jt.values(), jt.lengths(), self.encoder.max_length,
                              self.exclude_history)
        top = None
        if k:  # the first k that are not excluded
            top = first_k_outside(*self.head.topk(last, k + seen.shape[1]), seen, k)[1]
        ranks = (self.head.target_rank(last, targets, seen)
                 if hasattr(self.head, "target_rank") else None)
        return losses, top, ranks
