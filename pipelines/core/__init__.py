"""What every ingestion family shares, so that no family imports another.

- :mod:`pipelines.core.errors`: :class:`~pipelines.core.errors.IngestError`, the one-line error;
- :mod:`pipelines.core.fields`: the spec enums and feature specs of every family (input formats,
  value types, encodings, split methods, dense/sparse/output specs);
- :mod:`pipelines.core.inputs`: input resolution (paths, directories, globs), the cheap per-file
  checks (parquet footers, CSV headers), file splits, the ``__row``/``__file`` columns;
- :mod:`pipelines.core.hashing`: stable hashes for splits, hash buckets and partitions;
- :mod:`pipelines.core.encode`: vocabularies and the dense and categorical encoders;
- :mod:`pipelines.core.stats`: vocabularies from value counts, out-of-vocabulary rates;
- :mod:`pipelines.core.report`: the report's accounting rules (the ``__drop`` code, repaired
  values, the splits ``metadata.json`` lists, its format version);
- :mod:`pipelines.core.output`: phase timing, the split writer (``sink_splits``) and the rules
  for the output folder;
- :mod:`pipelines.core.serve`: serving raw rows (``embedtrain predict --raw``): valid rows in
  batches of an exact size, the account of the rows not scored.

Nothing here imports a family (:mod:`pipelines.tabular`, :mod:`pipelines.xc`,
:mod:`pipelines.graph`) or an engine.
"""
