"""Export and batch scoring: a run's checkpoint as files for inference, and scoring rows with them.

:mod:`~embedtrain.export.export` writes an export directory (``embedtrain export``): embedding
tables read from the DCP checkpoint shard by shard (float32 or TorchRec's int8/int4 rows), an XC
class head, the dense model as a ``torch.export`` program and the ``model.json`` manifest
(:mod:`~embedtrain.export.manifest`); :mod:`~embedtrain.export.tables` holds the shard streaming
and the table files; :mod:`~embedtrain.export.predict` loads an export and scores parquet rows
batch by batch (``embedtrain predict``); :mod:`~embedtrain.export.nodes` reads a GNN export's
per-node outputs (layer-wise full-graph inference, computed at export) and looks node ids up in
them. Import from the modules (this package exports nothing,
so importing it loads no torch).

Example:
    >>> from embedtrain.export.export import export_run
    >>> from embedtrain.export.predict import predict
    >>> export_run("runs/demo", "exports/demo")
    >>> predict("exports/demo", ["data/synthetic_ctr/test"], "preds.parquet").metrics["auc"]
"""
