"""The accounting rules every family's report follows: each row read is written or dropped.

A job's parse stage adds :data:`DROP` to every row: null for a row that is kept, else the code of
the first reason it cannot be (the family's list of reasons, in priority order), so that the
report's ``rows_read`` is ``rows_written`` plus ``rows_dropped`` by reason. A value that is
repaired rather than dropped (a number that does not parse in a ``cast`` dense feature or a
bucketized one) is marked in an :func:`unparsed` column and counted under ``repairs``.
``metadata.json`` says :data:`FORMAT_VERSION` and lists the splits of :func:`written_splits`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from pipelines.core.output import SPLITS


_GENERIC_STEMS = re.compile(r"(train|test|valid|validation|val|data|part-\d+)",
                            re.IGNORECASE)


def dataset_name(spec: Any, files: Sequence[Path], default: str) -> str:
    """The data set's name, which a run on it prints: ``name:`` of the spec, else the first input
    file's name without its extensions, or its folder's where the file's is a split's or a part's
    (``eurlex/train.txt``: ``eurlex``; ``raw/events/part-00000.csv``: ``events``), else
    ``default``."""
    if spec.name:
        return spec.name
    if not files:
        return default
    path = Path(files[0]).absolute()
    stem = path.name.split(".")[0]
    if _GENERIC_STEMS.fullmatch(stem) and path.parent.name:
        folder = path.parent.name
        return folder if not _GENERIC_STEMS.fullmatch(folder) or not path.parent.parent.name \
            else f"{path.parent.parent.name}_{folder}"
    return stem or default

FORMAT_VERSION = 1
DROP = "__drop"


def unparsed(name: str) -> str:
    """The boolean column marking the values of a ``cast`` dense feature (or a bucketized feature
    of a text input) that did not parse: they are repaired (fill_null, bucket 0) and counted."""
    return f"__unparsed:{name}"


def written_splits(written: dict[str, list[tuple[str, int]]]) -> list[str]:
    """The splits metadata.json lists: train always, valid and test only when they have rows."""
    return [s for s in SPLITS if s == "train" or sum(r for _, r in written.get(s, [])) > 0]
