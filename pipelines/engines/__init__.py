"""Engines run a job's passes; every family's job runs on every engine with the same outputs.

- :mod:`pipelines.engines.base`: the interface (:class:`~pipelines.engines.base.Engine`,
  :class:`~pipelines.engines.base.Pass`, :class:`~pipelines.engines.base.Shard`);
- :mod:`pipelines.engines.local`: ``polars``, one process: the whole input as one shard, read
  by one multi-file Polars streaming scan per pass;
- :mod:`pipelines.engines.ray`: ``ray``, Ray Core tasks, one per input file and pass, on a local
  Ray instance or a cluster (``--address``).

:func:`open_engine` makes one by its ``--engine`` name. Engines never import a family; families
use only :mod:`pipelines.engines.base` (and the local engine as their default).
"""

from __future__ import annotations

from typing import Optional

from pipelines.core.errors import IngestError
from pipelines.engines.base import Engine

ENGINES = ("polars", "ray")


def open_engine(name: str = "polars", address: Optional[str] = None,
                num_cpus: Optional[int] = None) -> Engine:
    """The engine ``--engine name`` selects (use it as a context manager: a local Ray instance
    stops at the end of the ``with``).

    Raises:
        IngestError: an unknown name, or Ray options for the local engine.
    """
    if name not in ENGINES:
        raise IngestError(f"--engine: {name!r} is not one of {', '.join(ENGINES)}")
    if name == "polars":
        if address is not None or num_cpus is not None:
            raise IngestError("--address and --num-cpus are for --engine ray")
        from pipelines.engines.local import LocalEngine

        return LocalEngine()
    from pipelines.engines.ray import RayEngine

    return RayEngine(address, num_cpus)
