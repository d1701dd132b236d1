"""The accounting rules every family's report follows: each row read is written or dropped.

A job's parse stage adds :data:`DROP` to every row: null for a row that is kept, else the code of
the first reason it cannot be (the family's list of reasons, in priority order), so that the
report's ``rows_read`` is ``rows_written`` plus ``rows_dropped`` by reason. A value that is
repaired rather than dropped (a number that does not parse in a ``cast`` dense feature or a
bucketized one) is marked in an :func:`unparsed` column and counted under ``repairs``.
``metadata.json`` says :data:`FORMAT_VERSION` and lists the splits of :func:`written_splits`.
"""

from __future__ import annotations

from pipelines.core.output import SPLITS

FORMAT_VERSION = 1
DROP = "__drop"


def unparsed(name: str) -> str:
    """The boolean column marking the values of a ``cast`` dense feature (or a bucketized feature
    of a text input) that did not parse: they are repaired (fill_null, bucket 0) and counted."""
    return f"__unparsed:{name}"


def written_splits(written: dict[str, list[tuple[str, int]]]) -> list[str]:
    """The splits metadata.json lists: train always, valid and test only when they have rows."""
    return [s for s in SPLITS if s == "train" or sum(r for _, r in written.get(s, [])) > 0]
