"""Offline data jobs (Arrow/Polars): raw inputs to clean, sharded data sets with reports.

Nothing here runs during training. ``embedtrain ingest SPEC --input ... --out DIR`` calls
:func:`run_ingest`, which reads the spec's ``kind`` (:func:`kind_of`) and runs that family's job
on the engine ``--engine`` names. One folder per family, each with the same roles:

- :mod:`pipelines.tabular` (no ``kind``): click logs (Criteo TSV, CSV, parquet) to split parquet
  with vocabularies;
- :mod:`pipelines.xc` (``kind: xc``): multi-label text/ids (the Extreme Classification
  Repository format, parquet, CSV) to the data set ``task: xc`` trains on;
- :mod:`pipelines.graph` (``kind: graph``): edge lists and a node table to a memory-mapped CSR
  with node arrays and splits;
- :mod:`pipelines.sequence` (``kind: sequence``): event logs (user, item, time) to one row per
  user with the items in time order, split leave-last-out or by time (``task: seq``).

Each holds ``spec.py`` (the typed YAML spec and its checks), ``read.py`` (its input layouts:
their checks, the Polars scans), ``passes.py`` (the job: passes over shards of the input, see
:mod:`pipelines.engines.base`) and ``report.py`` (``ingest_report.json``, ``metadata.json``, the
summary lines). :mod:`pipelines.core` is what they share (errors, the shared spec fields, input
resolution and cheap file checks, stable hashes, encoders, statistics, the report's accounting
rules, the split writer, the output folder's rules), and no family imports another;
:mod:`pipelines.engines` runs the passes: ``polars`` (one process,
:mod:`pipelines.engines.local`) or ``ray`` (Ray Core tasks, one per input file,
:mod:`pipelines.engines.ray`), with the same outputs. A new kind is one more folder like these
(importing :mod:`pipelines.core` and :mod:`pipelines.engines.base`) and one entry in
:data:`FAMILIES`.

The output appears whole or not at all: the job writes into a temporary folder beside
``--out`` (``.<name>.tmp-<host>-<pid>``) that replaces ``--out`` only once complete
(:mod:`pipelines.core.atomic`; ``embedtrain datagen`` writes the same way through
:func:`atomic_output`), so an interrupted or failed job leaves ``--out`` as it was, and the next
job removes what a killed one left. An earlier ingest output at ``--out`` is replaced;
``overwrite`` (``--overwrite``) replaces any earlier data set (:func:`pipelines.core.output.
ingest_refusal`).

Importing this package imports no Polars: the families load on first use.

The synthetic generators live in ``embedtrain.datagen`` (torch-free): ``embedtrain.datagen.ctr``
(parquet) and ``embedtrain.datagen.tsv`` (the same rows as raw TSV).

Example:
    >>> report, lines = run_ingest("configs/ingest/criteo_synthetic.yaml",
    ...                            ["data/raw_ctr/*.tsv"], "data/ctr")  # doctest: +SKIP
    >>> print("\\n".join(lines))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from pipelines.core.atomic import OutputError, Staging, atomic_output, foreign_entries

# kind -> the family's package; each has spec.load_spec, passes.ingest and report.summary_lines
FAMILIES = {"tabular": "pipelines.tabular", "xc": "pipelines.xc", "graph": "pipelines.graph",
            "sequence": "pipelines.sequence"}


def kind_of(spec_path: str | os.PathLike) -> str:
    """The spec's family: its top-level ``kind`` (``xc``, ``graph``), ``tabular`` without one.

    Raises:
        ConfigError: an unknown ``kind``.
    """
    import yaml

    from embedtrain.config_io import ConfigError, SafeLoader

    try:
        with open(spec_path) as f:
            data = yaml.load(f, Loader=SafeLoader)  # bounded aliases, duplicate keys refused
    except (OSError, yaml.YAMLError):
        return "tabular"  # the tabular loader reports the file's problem in its own words
    kind = data.get("kind", "tabular") if isinstance(data, dict) else "tabular"
    if kind not in FAMILIES:
        raise ConfigError(f"{spec_path}: kind: {kind!r} is not one of "
                          f"{', '.join(k for k in FAMILIES if k != 'tabular')} (or no kind: a "
                          "tabular spec)")
    return kind


def load_spec(spec_path: str | os.PathLike, overrides: Sequence[str] = ()) -> Any:
    """The spec of its family (:func:`kind_of`), ``--set`` overrides applied."""
    family = FAMILIES[kind_of(spec_path)]
    return importlib.import_module(f"{family}.spec").load_spec(spec_path, list(overrides))


def run_ingest(spec_path: str | os.PathLike, inputs: Sequence[str | os.PathLike],
               out: str | os.PathLike, *, overrides: Sequence[str] = (),
               nodes: Sequence[str | os.PathLike] = (), engine: str = "polars",
               address: Optional[str] = None, num_cpus: Optional[int] = None,
               progress: bool = True, overwrite: bool = False,
               extend: Optional[str | os.PathLike] = None) -> tuple[dict, list[str]]:
    """Loads the spec, runs its family's job on the named engine in a temporary folder beside
    ``out`` that then replaces ``out`` (:func:`atomic_output`); returns the report and the
    summary lines to print.

    Args:
        spec_path: the YAML spec (``configs/ingest/``).
        inputs: files, directories or globs (``--input``).
        out: the output folder (``--out``).
        overrides: ``KEY=VALUE`` spec overrides (``--set``).
        nodes: graph specs only: the node table (``--nodes``).
        engine, address, num_cpus: :func:`pipelines.engines.open_engine`.
        progress: progress bars on stderr.
        overwrite: replace any earlier data set at ``out``, not only an earlier ingest output.
        extend: tabular specs only: a data set this one continues (the partition before it):
            its vocabularies keep their ids and new values are appended, its dense constants
            and bucket boundaries are reused (:func:`pipelines.tabular.extend.base_of`).

    Raises:
        IngestError: bad input, or ``--nodes`` with a spec that is not a graph spec.
        OutputError: ``out`` may not be replaced (a file, under a file, a folder that is not
            an earlier output, another job writing it) or cannot be written (a full disk); the
            earlier data set at ``out`` is then untouched.
        ConfigError: a bad spec.
    """
    from pipelines.core.errors import IngestError
    from pipelines.core.output import ingest_refusal
    from pipelines.engines import open_engine

    kind = kind_of(spec_path)
    if nodes and kind != "graph":
        raise IngestError("--nodes: only for graph specs (kind: graph)")
    family = FAMILIES[kind]
    spec = load_spec(spec_path, overrides)
    job = importlib.import_module(f"{family}.passes")
    extra = {"nodes": list(nodes)} if kind == "graph" else {}
    if extend is not None:
        if kind != "tabular":
            raise IngestError(f"--extend: only for tabular specs, not kind: {kind}")
        extra["extend"] = Path(extend)
    refusal = functools.partial(ingest_refusal, overwrite=overwrite)
    with atomic_output(out, refusal, job="ingest") as staging:
        with open_engine(engine, address, num_cpus) as eng:
            report = job.ingest(spec, list(inputs), staging.path, progress=progress, engine=eng,
                                **extra)
    report = staging.unmask(report)
    lines = importlib.import_module(f"{family}.report").summary_lines(report, out, engine)
    return report, lines


def raw_rows(meta: dict, root: str | os.PathLike, inputs: Sequence[str],
             keep: Sequence[str] = (), on_invalid: str = "drop",
             where: Optional[str | os.PathLike] = None) -> Any:
    """Serving: raw rows encoded by the ingestion that made a data set, its family's
    ``serve.RawRows`` (:mod:`pipelines.tabular.serve`, :mod:`pipelines.xc.serve`).

    Args:
        meta: the data set's ``metadata.json`` (its ``spec``, vocabulary files, constants).
        root: where its vocabulary files lie (the data set, or an export of a run on it).
        inputs: raw files, directories or globs.
        keep: input columns carried to the output.
        on_invalid: ``drop`` (count invalid rows) or ``error`` (stop at the first).
        where: the metadata's file, for messages.

    Raises:
        IngestError: a data set not made by ``embedtrain ingest`` (generated data sets have no
            raw layout), a graph data set, or inputs that cannot be read (one line).
    """
    from pipelines.core.errors import IngestError

    where = where or Path(root) / "metadata.json"
    if meta.get("task") == "retrieval" and "spec" in meta:
        raise IngestError(f"{where}: a retrieval data set ingested from events: a query's "
                          f"history is made by embedtrain ingest (per user, sorted); score its "
                          f"parquet rows (ids of vocab/) without --raw")
    if meta.get("task") == "seq" or meta.get("kind") == "sequence":
        raise IngestError(f"{where}: a sequence data set: raw events become histories only by "
                          f"embedtrain ingest (per user, sorted, split); score its parquet rows "
                          f"(items, target) without --raw")
    if "spec" not in meta:
        raise IngestError(f"{where}: the data set was not made by embedtrain ingest (no spec: "
                          "generated data has no raw layout); score its parquet rows without "
                          "--raw")
    if meta.get("task") == "gnn" or meta.get("kind") == "graph":
        raise IngestError(f"{where}: a graph data set; raw rows are scored for ctr and xc")
    family = FAMILIES["xc" if meta.get("task") == "xc" else "tabular"]
    return importlib.import_module(f"{family}.serve").RawRows(meta, root, inputs, keep,
                                                              on_invalid)


def __getattr__(name: str) -> Any:
    """``KEEP_PREFIX`` (a served batch's kept input columns are named ``KEEP_PREFIX + name``),
    from :mod:`pipelines.core.inputs` on first use: importing this package loads no Polars."""
    if name == "KEEP_PREFIX":
        from pipelines.core.inputs import KEEP_PREFIX

        return KEEP_PREFIX
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")


__all__ = ["FAMILIES", "KEEP_PREFIX", "OutputError", "Staging", "atomic_output", "foreign_entries", "kind_of",
           "load_spec", "raw_rows", "run_ingest"]
