"""The ids of dynamic tables: the 63-bit mix that spreads raw ids over row-wise shards, its
inverse, and which shard's default row an id without a row looks up.

Split off :mod:`embedtrain.tables.dynamic` (the remapper) and shared with
:mod:`embedtrain.tables.fused` (the remap of a collection's tables together).

Example:
    >>> unmix_ids(mix_ids(torch.tensor([7, 2**40]))).tolist()
    [7, 1099511627776]
"""

from __future__ import annotations

import functools
import zlib

import torch
from torch import Tensor

EMPTY_ID = 2**63 - 1  # MCH's marker of a row no id owns (and of the default row)
_MASK = 2**63 - 1
_LOW, _HIGH = 2**32 - 1, 2**31 - 1  # an id's two halves: 32 low bits, 31 high bits
# Feistel round keys (odd, below 2^31: a 32-bit half times one stays below 2^63, no overflow)
_KEYS = (0x5BD1E995, 0x3C6EF372 | 1, 0x1B873593, 0x68E31DA5)


# What a stored (sorted) id is: mix_ids of the raw one. Recorded with an export's id maps so a
# change of the mix can never be applied to a checkpoint or export written under another.
MIX_VERSION = "feistel4-v1"


def _round(half: Tensor, key: int, mask: int) -> Tensor:
    """A Feistel round function: the middle bits of ``half * key`` (no int64 overflow)."""
    return ((half * key) >> 15) & mask


def mix_ids(ids: Tensor, input_hash_size: int = 0) -> Tensor:
    """A bijection of ``[0, 2^63)`` that spreads ids over the row-wise shards' id blocks.

    A four-round unbalanced Feistel network over the ids' 31 high and 32 low bits: invertible
    whatever its round function (:func:`unmix_ids`), every output bit depends on every input bit,
    and no intermediate exceeds int64 (signed overflow is not defined behaviour). ``EMPTY_ID``
    (2^63 - 1, MCH's empty-row marker) is never returned: the one id mapped to it takes
    ``EMPTY_ID - 1`` instead (it then shares that id's row: one pair in 2^63).
    ``input_hash_size`` is TorchRec's hash-function argument, unused.
    """
    low = ids & _MASK
    high = low >> 32
    low &= _LOW
    step = torch.empty_like(low)  # in place: a step's ids are many, temporaries page-fault
    for i, key in enumerate(_KEYS):  # high ^= _round(low, ...), then low ^= _round(high, ...)
        src, dst, mask = (low, high, _HIGH) if i % 2 == 0 else (high, low, _LOW)
        torch.mul(src, key, out=step)
        dst ^= step.bitwise_right_shift_(15).bitwise_and_(mask)
    x = high.bitwise_left_shift_(32).bitwise_or_(low)
    return x.masked_fill_(x == EMPTY_ID, EMPTY_ID - 1)


def unmix_ids(mixed: Tensor) -> Tensor:
    """The ids :func:`mix_ids` maps to ``mixed`` (its inverse)."""
    x = mixed & _MASK
    high, low = x >> 32, x & _LOW
    for i in reversed(range(len(_KEYS))):
        if i % 2 == 0:
            high = high ^ _round(low, _KEYS[i], _HIGH)
        else:
            low = low ^ _round(high, _KEYS[i], _LOW)
    return (high << 32) | low


@functools.lru_cache(maxsize=256)
def column_keys(dim: int, salt: int) -> Tensor:
    """``dim`` distinct 63-bit keys of a table's columns (for ``ManagedTable.initial_vectors``)."""
    return mix_ids(torch.arange(dim, dtype=torch.int64) * 0x9E3779B9 + (salt << 20))


def table_salt(name: str) -> int:
    """A table's salt for :func:`column_keys` (from its name: the same on every rank)."""
    return zlib.crc32(str(name).encode())


def id_uniforms(ids: Tensor, keys: Tensor) -> Tensor:
    """Uniforms in ``[0, 1)`` from a hash of each id with each column key (broadcast: ids
    ``[n, 1]``, keys ``[1, dim]`` or ``[n, dim]``): the top 24 bits of the mixed pair, float32
    (what a fresh row of a dynamic table starts from, ``ManagedTable.initial_vectors``)."""
    return (mix_ids(ids ^ keys) >> 39).to(torch.float32) / 2**24


def checkpoint_default_rows(mixed_ids: Tensor, segments: Tensor) -> Tensor:
    """The default row each (mixed) id looked up in a run whose row-wise shards start at
    ``segments`` (``[0, s1, ..., rows]``): the last row of the shard of its block of the id
    range, as TorchRec's row-wise input distribution assigns it."""
    shards = segments.numel() - 1
    block = -(-EMPTY_ID // shards)
    return segments.to(mixed_ids.device)[mixed_ids // block + 1] - 1
