"""The sequence ingestion spec: ``kind: sequence`` YAML (``configs/ingest/sequence_events.yaml``,
``configs/ingest/retrieval_events.yaml``).

An event log (one row per interaction: user, item, time) becomes one row per user with the
items in time order (``task: seq``, :mod:`pipelines.sequence.passes`), or one row per event with
the user's features and recent items as the query and an item table (``task: retrieval``,
:mod:`pipelines.sequence.retrieval`): one event log serves both. :func:`load_spec` reads the
spec into a :class:`SequenceIngestSpec` through :mod:`embedtrain.config_io` (one-line errors
naming the file and key) and checks what spans keys: keys that mean nothing for the chosen
split method or task are refused, not ignored.
"""

from __future__ import annotations

import datetime
import enum
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from embedtrain.config_io import ConfigError, config_field, load_dataclass
from pipelines.core.fields import InputFormat, OutputSpec, ValueType

EXTENSIONS = {InputFormat.CSV: (".csv", ".tsv", ".txt"), InputFormat.PARQUET: (".parquet",)}


class SequenceSplit(enum.Enum):
    """How a user's events become train, valid and test rows."""

    # the standard protocol: test = each user's last item, valid = the one before, train = the rest
    LEAVE_LAST_OUT = "leave_last_out"
    # by time: events from split.valid_time on are valid targets, from split.test_time on test
    # targets, each predicted from every earlier event of its user
    TIME = "time"


@dataclass
class SequenceInputSpec:
    """The event files' layout."""

    format: InputFormat = InputFormat.CSV           # csv or parquet
    separator: Optional[str] = None                 # csv only (default ",")
    null_values: list[str] = field(default_factory=list)  # csv: extra null markers


@dataclass
class SequenceSplitSpec:
    method: SequenceSplit = SequenceSplit.LEAVE_LAST_OUT  # leave_last_out or time
    # method: time: the first valid and the first test time, numbers in the time column's unit
    # (e.g. Unix seconds) or ISO dates ("2024-01-31", "2024-01-31T12:00:00"; UTC)
    valid_time: Optional[str] = config_field(None, text=True)
    test_time: Optional[str] = config_field(None, text=True)  # see valid_time


@dataclass
class SequenceItemsSpec:
    """``task: retrieval``: the item table, every item's features (items no event names too)."""

    path: Optional[str] = config_field(None, text=True)  # csv/tsv or parquet (by its extension)
    id: str = "item"                                # its item id column (the events' item ids)
    features: list[str] = field(default_factory=list)  # categorical item features (columns)


@dataclass
class SequenceIngestSpec:
    """A whole sequence ingestion job."""

    kind: str = "sequence"  # this spec's family (pipelines.kind_of reads it)
    # seq: one row per user (next-item models); retrieval: one row per event, the query the
    # user's features and recent items, the label the event's item (two-tower models)
    task: str = "seq"
    name: Optional[str] = None                      # default: the first input file's name
    input: SequenceInputSpec = field(default_factory=SequenceInputSpec)
    user: str = "user"                              # the columns: user id, item id, event time
    item: str = "item"                              # the item id column
    time: str = "timestamp"                         # numbers (e.g. Unix s) or dates
    id_type: ValueType = ValueType.STRING           # user and item ids compared as strings or ints
    max_length: int = 50                            # items of history a row keeps (the newest)
    min_length: int = 5                             # users with fewer events are dropped, counted
    # how a user's events become train, valid and test rows
    split: SequenceSplitSpec = field(default_factory=SequenceSplitSpec)
    output: OutputSpec = field(default_factory=OutputSpec)  # the written parquet files' layout
    # task: retrieval: event columns kept as categorical query features (the value at the row's
    # event), and the item table (without a path: the items of the log, no features)
    user_features: list[str] = field(default_factory=list)
    items: SequenceItemsSpec = field(default_factory=SequenceItemsSpec)

    def split_times(self) -> tuple[float, float]:
        """``method: time``: (first valid time, first test time) as numbers (dates: Unix s)."""
        return _time_value(self.split.valid_time), _time_value(self.split.test_time)


def _time_value(text: Optional[str]) -> float:
    """A cut-off as a number: the value itself, or an ISO date/datetime as Unix seconds (UTC)."""
    if text is None:
        raise ValueError("no time given")
    try:
        value = float(text)
    except ValueError:
        moment = datetime.datetime.fromisoformat(str(text))
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.timezone.utc)
        return moment.timestamp()
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text}")
    return value


def load_spec(path: str | os.PathLike, overrides: Optional[list[str]] = None
              ) -> SequenceIngestSpec:
    """Reads and validates a sequence ingestion spec.

    Args:
        path: the YAML file.
        overrides: ``key.path=value`` strings (``max_length=200``).

    Raises:
        ConfigError: one line naming the file and key path.

    Example:
        >>> load_spec("configs/ingest/sequence_events.yaml").split.method
        <SequenceSplit.LEAVE_LAST_OUT: 'leave_last_out'>
    """
    spec = load_dataclass(path, SequenceIngestSpec, overrides)

    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{path}: {key}: {message}")

    if spec.kind != "sequence":
        fail("kind", f"expected 'sequence', got {spec.kind!r}")
    i = spec.input
    if i.format not in EXTENSIONS:
        fail("input.format", f"must be csv or parquet, got {i.format.value}")
    if i.separator is not None and (i.format is not InputFormat.CSV or len(i.separator) != 1):
        fail("input.separator", "one character, for format: csv only")
    if spec.task not in ("seq", "retrieval"):
        fail("task", f"expected seq or retrieval, got {spec.task!r}")
    if spec.task == "seq":
        for key, value in (("user_features", spec.user_features), ("items.path", spec.items.path),
                           ("items.features", spec.items.features)):
            if value:
                fail(key, "only for task: retrieval")
    elif spec.items.features and not spec.items.path:
        fail("items.features", "needs items.path (the item table's file)")
    columns = [spec.user, spec.item, spec.time, *spec.user_features]
    if len(set(columns)) != len(columns):
        what = "user, item, time and user_features" if spec.user_features else "user, item and time"
        fail("user", f"the {what} columns must differ, got {columns}")
    if spec.max_length < 1:
        fail("max_length", f"must be at least 1, got {spec.max_length}")
    if spec.min_length < 2:
        fail("min_length", f"must be at least 2 (a history and a target), got {spec.min_length}")
    s = spec.split
    if s.method is SequenceSplit.LEAVE_LAST_OUT:
        if spec.min_length < 3:
            fail("min_length", f"leave_last_out takes a valid and a test item from each user: "
                 f"at least 3, got {spec.min_length}")
        for key in ("valid_time", "test_time"):
            if getattr(s, key) is not None:
                fail(f"split.{key}", "only for split.method: time (method is leave_last_out)")
    else:
        times = {}
        for key in ("valid_time", "test_time"):
            if getattr(s, key) is None:
                fail(f"split.{key}", "split.method: time needs it (a number or an ISO date)")
            try:
                times[key] = _time_value(getattr(s, key))
            except ValueError:
                fail(f"split.{key}", f"not a number or an ISO date: {getattr(s, key)!r}")
        if times["valid_time"] > times["test_time"]:
            fail("split.test_time", f"must not be before split.valid_time "
                 f"({s.test_time} < {s.valid_time})")
    return spec
