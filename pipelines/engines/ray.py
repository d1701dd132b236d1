"""``--engine ray``: every pass as Ray Core tasks, one per input file, on Ray's workers.

The job's code is the same as on the local engine: each task reads one input file with Polars
(numbered from the rows of the files before it, so row numbers, and the splits hashed from them,
are global), and the job merges the per-file parts where it runs. Ray Core tasks, not Ray
Data's operators: each pass is a handful of per-file tasks whose results are small frames, which
Ray Data's streaming executor would schedule with seconds of overhead per stage on this scale of
work.

Without ``address`` the engine starts a local Ray instance of ``num_cpus`` CPUs on its first pass
(a job whose input checks fail starts none) and stops it on :meth:`RayEngine.close`; with one it joins a running cluster (``ray start --head`` on one
machine, ``ray start --address`` on the others), whose nodes must all see the input files and
the output directory (a shared or network file system) and have embedtrain installed. Tasks run
with one Polars thread each: the tasks, one per CPU, are the parallelism.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pipelines.core.errors import IngestError
from pipelines.engines.base import Engine, Shard

RAY_REQUIREMENT = "ray[data]==2.60.0"


def _ray():
    try:
        import ray
    except ImportError:
        raise IngestError(f"--engine ray needs Ray: pip install '{RAY_REQUIREMENT}' (or "
                          f"requirements/cpu.txt)") from None
    return ray


def worker_peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``): the report's per-worker figure."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _call(task: Callable[[Shard, Any], Any], shard: Shard, shared: Any) -> tuple:
    """A task as it runs on a worker: its part, the worker's pid and peak memory."""
    return task(shard, shared), os.getpid(), worker_peak_rss_bytes()


class RayEngine(Engine):
    """A Ray instance for a job: joins ``address``, or starts a local one (``num_cpus``)."""

    name = "ray"

    def __init__(self, address: Optional[str] = None, num_cpus: Optional[int] = None) -> None:
        _ray()  # installed? (one line if not)
        if num_cpus is not None and num_cpus < 1:
            raise IngestError(f"--num-cpus: must be at least 1, got {num_cpus}")
        if address is not None and num_cpus is not None:
            raise IngestError("--num-cpus is for a local instance; a cluster at --address has "
                              "its own CPUs")
        self.address, self.num_cpus = address, num_cpus
        self.started = False
        self.remote = None
        self.tasks = 0
        self.peaks: dict[str, int] = {}

    def _connect(self):
        """Joins or starts Ray on first use: a job that fails its input checks starts none."""
        ray = _ray()
        if self.remote is not None:
            return ray
        if not ray.is_initialized():
            env = {"env_vars": {"POLARS_MAX_THREADS": "1"}}
            try:
                ray.init(address=self.address, num_cpus=self.num_cpus, include_dashboard=False,
                         log_to_driver=False, configure_logging=False, runtime_env=env)
            except (ConnectionError, RuntimeError, ValueError) as e:
                what = (f"--address {self.address}: cannot join the Ray cluster" if self.address
                        else "cannot start a local Ray instance (RAY_ADDRESS set? it points "
                        "ray.init at a cluster)")
                raise IngestError(f"{what}: {str(e).strip().splitlines()[0]}") from None
            self.started = True
        elif self.address is not None or self.num_cpus is not None:
            raise IngestError("--address/--num-cpus: this process already runs Ray; the job "
                              "uses that instance (leave them out)")
        self.remote = ray.remote(_call)
        return ray

    def shards(self, files: Sequence[Path]) -> list[Shard]:
        return [Shard((f,), index=i) for i, f in enumerate(files)]

    def map(self, task: Callable[[Shard, Any], Any], shards: Sequence[Shard],
            shared: Any = None) -> list:
        ray = self._connect()
        ref = ray.put(shared)
        refs = [self.remote.remote(task, s, ref) for s in shards]
        try:
            done = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):  # as in one process: the job's handlers apply
                raise cause from None
            raise
        self.tasks += len(done)
        for _, pid, peak in done:
            self.peaks[str(pid)] = max(self.peaks.get(str(pid), 0), peak)
        return [part for part, _, _ in done]

    def describe(self) -> dict:
        cpus = max(1, int(self._connect().cluster_resources().get("CPU", 1)))
        return {"name": self.name, "cpus": cpus, "tasks": self.tasks,
                "worker_peak_rss_bytes": dict(self.peaks)}

    def close(self) -> None:
        if self.started:
            _ray().shutdown()
            self.started = False
