"""Graph ingestion (``kind: graph``): edge lists and a node table to the graph format.

- :mod:`pipelines.graph.spec`: the typed YAML spec;
- :mod:`pipelines.graph.read`: input files, their column and parse checks, the edge frame and
  the node table;
- :mod:`pipelines.graph.splits`: node splits (random, a column, id files);
- :mod:`pipelines.graph.passes`: the job (:func:`~pipelines.graph.passes.ingest`);
- :mod:`pipelines.graph.report`: ``ingest_report.json`` and the summary lines.
"""
