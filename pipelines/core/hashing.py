"""Stable hashes for splitting rows and bucketing categorical values.

Both must give the same answer on any machine, in any Polars version and in a serving stack that
is not Python, so neither uses Polars' own ``Expr.hash`` (stable only within one Polars release):

- :func:`splitmix64` (Steele et al.'s finaliser) of an unsigned 64-bit integer, written with Polars
  integer expressions (wrapping multiplication, shifts as divisions), so it streams natively;
- :func:`fnv1a64` of a value's UTF-8 bytes (its decimal text for integers), then ``splitmix64``:
  FNV-1a alone has weak low bits, and buckets are taken modulo N.

Reference, for reimplementation elsewhere::

    h = 0xcbf29ce484222325
    for b in utf8(value): h = ((h ^ b) * 0x100000001b3) mod 2**64
    bucket = 1 + splitmix64(h) mod (N - 1)        # 0 is the null bucket

Example:
    >>> import polars as pl
    >>> pl.select(string_hash(pl.lit("68fd1e64"))).item()  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _u64(x: int) -> pl.Expr:
    return pl.lit(x, dtype=pl.UInt64)


def _xorshift(z: pl.Expr, bits: int) -> pl.Expr:
    return z ^ (z // _u64(1 << bits))  # a logical right shift of an unsigned integer


def splitmix64(x: pl.Expr, seed: int = 0) -> pl.Expr:
    """The splitmix64 finaliser of ``x + (seed + 1) * golden`` (all mod 2**64), as a UInt64 expr.

    Args:
        x: an integer expression (cast to UInt64; negative values wrap).
        seed: mixes a different, equally uniform function per seed.

    Returns:
        A UInt64 expression, uniform over 64 bits for distinct inputs.

    Example:
        >>> pl.select(splitmix64(pl.lit(1))).item()
        10451216379200822465
    """
    z = x.cast(pl.UInt64, wrap_numerical=True) + _u64(((seed + 1) * _GOLDEN) % 2**64)
    z = _xorshift(z, 30) * _u64(_M1)
    z = _xorshift(z, 27) * _u64(_M2)
    return _xorshift(z, 31)


def fnv1a64(values: pa.Array) -> np.ndarray:
    """FNV-1a (64-bit) of each string's UTF-8 bytes, vectorised over one byte position at a time.

    Args:
        values: a string array (nulls hash as the empty string; callers map nulls separately).

    Returns:
        ``np.uint64`` array, one hash per value.

    Example:
        >>> int(fnv1a64(pa.array(["a"]))[0]) == 0xAF63DC4C8601EC8C
        True
    """
    values = values.cast(pa.large_string())
    n = len(values)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64)
    offsets = offsets[values.offset:values.offset + n + 1]
    buffer = values.buffers()[2]
    data = np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    width = int(lengths.max()) if n else 0
    filled = lengths == width
    if width and (filled | (lengths == 0)).all():
        # Fixed-width tokens (Criteo's hex ids), some empty or null: empty strings own no bytes,
        # so the others' bytes are one contiguous (rows, width) matrix: no per-byte gathers.
        matrix = data[offsets[0]:offsets[-1]].reshape(-1, width)
        part = np.full(len(matrix), _FNV_OFFSET, dtype=np.uint64)
        for j in range(width):
            part = (part ^ matrix[:, j]) * _FNV_PRIME
        h[filled] = part
        return h
    active = np.arange(n)
    j = 0
    while active.size:  # strings are short (ids, tokens): a few passes over shrinking index sets
        active = active[lengths[active] > j]
        byte = data[starts[active] + j].astype(np.uint64)
        h[active] = (h[active] ^ byte) * _FNV_PRIME  # uint64 arithmetic wraps, as FNV wants
        j += 1
    return h


def _fnv_series(s: pl.Series) -> pl.Series:
    return pl.Series(s.name, fnv1a64(s.to_arrow()), dtype=pl.UInt64)


def string_hash(expr: pl.Expr, seed: int = 0) -> pl.Expr:
    """Stable 64-bit hash of a String expression: ``splitmix64(fnv1a64(utf8), seed)``.

    Runs per streaming batch (an elementwise NumPy function), so it never gathers a column.

    Args:
        expr: a String expression (cast integers with ``.cast(pl.String)`` first).
        seed: see :func:`splitmix64`.

    Returns:
        A UInt64 expression.
    """
    fnv = expr.map_batches(_fnv_series, return_dtype=pl.UInt64, is_elementwise=True)
    return splitmix64(fnv, seed)


def unit_interval(h: pl.Expr) -> pl.Expr:
    """Maps a UInt64 hash onto [0, 1) using its top 53 bits (exact in a float64)."""
    return (h // _u64(1 << 11)).cast(pl.Float64) / float(1 << 53)
