"""Class heads over C classes, as TorchRec keeps sharded modules apart from plain ones.

``build``: a head by kind (:func:`~embedtrain.heads.build.build_head`) and what the planner sees
of it; ``sharded``: the model-parallel heads (full softmax, Partial FC, hard negatives: each
rank a slice of the classes, their collectives and custom autograd in ``ops``); ``replicated``:
adaptive softmax and MACH; ``sample``: the class samples; ``index``: the clustered index behind
sub-linear hard negatives; ``topk``: the one blocked and distributed running top-k;
``low_precision``: bf16 / fp8 rows. Import from the modules (this package exports nothing, so
the config schema's enums load no torch).
"""
