"""Architectures: plain ``nn.Module``s built on TorchRec modules; they know nothing of ranks,
files or configs, and hold no collective (a class head's are :mod:`embedtrain.heads`', a dynamic
table's :mod:`embedtrain.tables`').

Import from the modules: ``embedtrain.models.dlrm`` (DLRM, DCNv2, DeepFM), ``.xc`` (the XC
encoder and model), ``.seq`` (SASRec, HSTU), ``.gnn`` (GraphSAGE), ``.layerwise`` (its
layer-wise full-graph inference), ``.options`` (the enums the config schema uses; no torch
import, which is why this package exports nothing).
"""
