"""``--engine polars``: every pass in this process, over one shard holding every input file.

Each task is then one multi-file Polars streaming scan (Polars' own threads are the
parallelism), so this engine gives exactly what a job written without shards gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from pipelines.engines.base import Engine, Shard


class LocalEngine(Engine):
    name = "polars"

    def shards(self, files: Sequence[Path]) -> list[Shard]:
        return [Shard(tuple(files))] if files else []

    def map(self, task: Callable[[Shard, Any], Any], shards: Sequence[Shard],
            shared: Any = None) -> list:
        return [task(s, shared) for s in shards]
