"""Tabular ingestion (specs without ``kind``): click logs to split, encoded parquet.

- :mod:`pipelines.tabular.spec`: the typed YAML spec (input format, label, dense/sparse
  features, split; the field specs it shares are :mod:`pipelines.core.fields`);
- :mod:`pipelines.tabular.read`: input files' cheap checks, the lazy scans;
- :mod:`pipelines.tabular.transforms`: parse, drop reasons, split (Polars expressions; the
  encoders are :mod:`pipelines.core.encode`);
- :mod:`pipelines.tabular.stats`: the statistics passes, their merges over shards;
- :mod:`pipelines.tabular.passes`: the job (:func:`~pipelines.tabular.passes.ingest`);
- :mod:`pipelines.tabular.report`: ``metadata.json``, ``ingest_report.json``, the row accounting
  checks and the summary lines.
"""
