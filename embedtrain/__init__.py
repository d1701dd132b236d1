"""embedtrain: training for models whose size lives in huge embedding tables and class heads.

DLRM-style CTR models, GNNs on sampled neighbourhoods and extreme classification, on TorchRec,
FBGEMM and torch.distributed, from a laptop CPU to many GPU hosts.
"""

__version__ = "0.1.0"
