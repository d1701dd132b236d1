"""Offline data jobs (Arrow/Polars): raw logs to clean, sharded parquet with metadata and reports.

Nothing here runs during training. The ingestion jobs (``embedtrain ingest``) arrive with the
pipelines issue; the synthetic generators live in ``embedtrain.data.datagen``.
"""
