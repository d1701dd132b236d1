"""The engine interface: a job of any kind gives the same data set whatever cuts its input.

:class:`ThreadEngine` is an engine in a dozen lines (one shard per input file, run on a thread
pool: Polars releases the GIL), the one ARCHITECTURE.md shows. Every kind runs on it and on the
local engine (one shard of every file); the outputs must agree by the rule of
:mod:`ingest_outputs`. A shard per file exercises what the Ray engine relies on (row offsets,
per-shard parts merged, per-shard part files) without starting Ray.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest_outputs import (  # noqa: E402
    SPECS, assert_same_outputs, write_criteo, write_events, write_graph, write_xc_parquet,
    write_xc_repository)

from pipelines import kind_of, run_ingest  # noqa: E402
from pipelines.core.errors import IngestError  # noqa: E402
from pipelines.engines import open_engine  # noqa: E402
from pipelines.engines.base import Engine, Shard  # noqa: E402
from pipelines.engines.local import LocalEngine  # noqa: E402


class ThreadEngine(Engine):
    """One shard per input file, the tasks on a pool of threads."""

    name = "threads"

    def shards(self, files):
        return [Shard((f,), index=i) for i, f in enumerate(files)]

    def map(self, task, shards, shared=None):
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda s: task(s, shared), shards))


def _job(kind: str):
    from importlib import import_module

    return (import_module(f"pipelines.{kind}.spec").load_spec,
            import_module(f"pipelines.{kind}.passes").ingest)


CASES = {
    "criteo_synthetic": lambda d: (write_criteo(d), [], {}),   # hash split of row positions
    "criteo": lambda d: (write_criteo(d), [], {}),             # time split by row order
    "xc_repository": lambda d: (*write_xc_repository(d), {}),
    "xc_parquet": lambda d: (write_xc_parquet(d), [], {}),
    "graph_edges": lambda d: ((g := write_graph(d))[0], [], {"nodes": g[1]}),
    "sequence_events": lambda d: (write_events(d), ["max_length=4"], {}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_shard_per_file_gives_what_one_shard_gives(name, tmp_path):
    inputs, overrides, extra = CASES[name](tmp_path)
    spec_path = SPECS / f"{name}.yaml"
    load, ingest = _job(kind_of(spec_path))
    spec = load(spec_path, overrides)
    ingest(spec, inputs, tmp_path / "one", progress=False, engine=LocalEngine(), **extra)
    ingest(spec, inputs, tmp_path / "many", progress=False, engine=ThreadEngine(), **extra)
    if kind_of(spec_path) not in ("graph", "sequence"):  # these write their files whole
        assert sorted(p.name for p in (tmp_path / "many" / "train").iterdir())[0] \
            .startswith("part-00000-")
    assert_same_outputs(tmp_path / "one", tmp_path / "many")


def test_run_ingest_dispatches_by_kind_and_prints_the_engine(tmp_path):
    edges, nodes = write_graph(tmp_path)
    report, lines = run_ingest(SPECS / "graph_edges.yaml", edges, tmp_path / "g", nodes=nodes,
                               progress=False)
    assert report["kind"] == "graph" and "(polars engine)" in lines[0]
    with pytest.raises(IngestError, match=r"^--nodes: only for graph specs \(kind: graph\)$"):
        run_ingest(SPECS / "criteo.yaml", edges, tmp_path / "t", nodes=nodes)
    with pytest.raises(IngestError, match="--address and --num-cpus are for --engine ray"):
        open_engine("polars", address="127.0.0.1:6379")
    with pytest.raises(IngestError, match="--engine: 'spark' is not one of polars, ray"):
        open_engine("spark")


def test_kind_of_reads_the_kind_and_refuses_an_unknown_one(tmp_path):
    from embedtrain.config import ConfigError

    assert [kind_of(SPECS / n) for n in ("criteo.yaml", "xc_parquet.yaml", "graph_edges.yaml")] \
        == ["tabular", "xc", "graph"]
    (tmp_path / "s.yaml").write_text("kind: video\n")
    with pytest.raises(ConfigError, match="kind: 'video' is not one of xc, graph"):
        kind_of(tmp_path / "s.yaml")


def test_importing_pipelines_imports_no_polars():
    import subprocess

    code = "import sys, pipelines; print('polars' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
