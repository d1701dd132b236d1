"""The engine interface: a job is passes over shards of its input files, each merged.

A *shard* is a list of input files with where its rows start in the whole input; an engine
chooses how the files are cut (:meth:`Engine.shards`: the local engine keeps one shard of all
files, the Ray engine one per file). A *pass* is a function run once per shard,
``task(shard, shared) -> part``, and a ``merge(parts) -> result`` run where the job runs; a
merge of one part must return it unchanged, so a one-shard engine gives the one-scan result
exactly. Tasks are module-level functions of the family (engines pickle them by reference) that
read their shard with Polars; ``shared`` is whatever every task needs (the spec, vocabularies),
sent once.

    engine.run(Pass("row statistics", _row_stats, merge_stats), shards, spec)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class Shard:
    """Files read together by one task. ``offset``: the whole input's rows before them (None
    when the shard is the whole input, so the files' own row numbers are the global ones);
    ``index``: the shard's place, for file names; ``extra``: what an earlier pass learnt about
    these files (e.g. Criteo's malformed lines)."""

    files: tuple[Path, ...]
    index: int = 0
    offset: Optional[int] = None
    extra: Any = None

    def with_(self, **changes) -> "Shard":
        return replace(self, **changes)


@dataclass(frozen=True)
class Pass:
    """One pass of a job: ``task(shard, shared)`` on every shard, then ``merge(parts)`` (parts
    in shard order; a merge of one part returns it)."""

    name: str
    task: Callable[[Shard, Any], Any]
    merge: Callable[[list], Any] = list


class Engine(ABC):
    """Runs passes. Subclasses give :attr:`name`, :meth:`shards` and :meth:`map`."""

    name: str

    @abstractmethod
    def shards(self, files: Sequence[Path]) -> list[Shard]:
        """The input cut into shards (in input order)."""

    @abstractmethod
    def map(self, task: Callable[[Shard, Any], Any], shards: Sequence[Shard],
            shared: Any = None) -> list:
        """``[task(s, shared) for s in shards]``, wherever the engine runs tasks; an exception
        in a task is raised here as itself (an IngestError stays one line)."""

    def run(self, p: Pass, shards: Sequence[Shard], shared: Any = None) -> Any:
        """One pass: its task on every shard, then its merge."""
        return p.merge(self.map(p.task, shards, shared))

    def describe(self) -> dict:
        """The report's ``engine`` section."""
        return {"name": self.name}

    def close(self) -> None:
        """Releases what the engine started (a local Ray instance)."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
