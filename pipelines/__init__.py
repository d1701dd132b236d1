"""Offline data jobs (Arrow/Polars): raw logs to clean, sharded parquet with metadata and reports.

Nothing here runs during training. ``embedtrain ingest SPEC --input ... --out DIR`` runs
:func:`pipelines.ingest.ingest` with a spec from :func:`pipelines.spec.load_spec`:

- :mod:`pipelines.spec`: the typed YAML spec (input format, label, dense/sparse features, split);
- :mod:`pipelines.sources`: input files, their cheap checks, one lazy multi-file scan;
- :mod:`pipelines.transforms`: parse, drop reasons, split, encodings (Polars expressions);
- :mod:`pipelines.stats`: the streaming statistics passes and vocabularies;
- :mod:`pipelines.report`: ``metadata.json`` and ``ingest_report.json``;
- :mod:`pipelines.hashing`: stable hashes for splits and hash buckets;
- :mod:`pipelines.graph`: the graph job (``kind: graph`` specs): edge lists and node tables to a
  memory-mapped CSR with node arrays and splits;
- :mod:`pipelines.xc`: the extreme-classification job (``kind: xc`` specs,
  :mod:`pipelines.xc_spec`, inputs in :mod:`pipelines.xc_sources`): Extreme Classification
  Repository files or parquet/CSV token and label columns to the data set ``task: xc`` trains on.

The synthetic generators live in ``embedtrain.datagen`` (torch-free): ``embedtrain.datagen.ctr``
(parquet) and ``embedtrain.datagen.tsv`` (the same rows as raw TSV).
"""
