"""A DLRM whose feature interaction is a learned gate instead of DLRM's dot products.

Named in the config by import path (``model: {_component_: gated:GatedDLRM, ...}``): its
hyperparameters are its own keys, checked against this signature; embedtrain passes the data
set's ``features`` and the ``device`` its tables are built on (``meta`` while planning).
"""

from typing import Sequence

import torch
from torch import nn

import embedtrain as et


class GatedDLRM(nn.Module):
    def __init__(self, features, embedding_dim: int = 16, hidden: Sequence[int] = (64,),
                 device=None):
        super().__init__()
        self.tables = et.embedding_bag_collection(features, embedding_dim, device)
        self.keys = [f.name for f in features.sparse]
        width = len(features.dense) + embedding_dim * len(self.keys)
        self.gate = nn.Linear(width, width)
        layers, last = [], width
        for size in hidden:
            layers += [nn.Linear(last, size), nn.ReLU()]
            last = size
        self.top = nn.Sequential(*layers, nn.Linear(last, 1))

    def forward(self, dense, sparse):  # -> one logit a row
        pooled = self.tables(sparse)  # KeyedTensor: pooled[feature] is [B, D]
        return self.forward_pooled(dense, torch.stack([pooled[k] for k in self.keys], 1))

    def forward_pooled(self, dense, pooled):  # after the lookups: what export writes
        x = torch.cat([torch.log1p(dense.clamp(min=0)), pooled.flatten(1)], dim=1)
        return self.top(x * torch.sigmoid(self.gate(x))).squeeze(-1)
