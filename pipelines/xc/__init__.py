"""Extreme-classification ingestion (``kind: xc``): multi-label text/ids to ``task: xc`` data.

- :mod:`pipelines.xc.spec`: the typed YAML spec;
- :mod:`pipelines.xc.read`: input files (Extreme Classification Repository, parquet, CSV),
  their checks, the scans and the parse;
- :mod:`pipelines.xc.passes`: the job (:func:`~pipelines.xc.passes.ingest`);
- :mod:`pipelines.xc.report`: ``metadata.json``, ``ingest_report.json``, the summary lines;
- :mod:`pipelines.xc.serve`: raw rows encoded by a data set's own ingestion, for
  ``embedtrain predict --raw`` (:func:`pipelines.raw_rows`).

It encodes tokens with the encoders every family shares (:mod:`pipelines.core.encode`,
:mod:`pipelines.core.stats`): a bag of tokens is a multi-hot sparse feature.
"""
