"""Sequence ingestion (``kind: sequence``): an event log (user, item, time) to one row per user
with the items in time order, split leave-last-out or by time (:mod:`pipelines.sequence.passes`).

The spec is :mod:`pipelines.sequence.spec`, the input checks and parsing
:mod:`pipelines.sequence.read`, the report and metadata :mod:`pipelines.sequence.report`.
"""
