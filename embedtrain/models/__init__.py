"""Plain ``nn.Module``s built on TorchRec modules; they know nothing of ranks, files or configs.

Import from the modules: ``embedtrain.models.dlrm`` (DLRM, DCNv2), ``.xc`` (encoder, heads),
``.class_head`` / ``.xc_heads``, ``.gnn`` (GraphSAGE), ``.layerwise`` (its layer-wise full-graph
inference), ``.topk`` (top-k kernels), ``.options``
(the enums the config schema uses; no torch import, which is why this package exports nothing).
"""
