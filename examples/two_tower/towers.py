"""A two-tower retrieval model on next-item data, as a query tower of one's own.

Query tower (this file): the mean of the user's history embeddings so far (causal: position t
sees items 0..t, so every position trains on its next item) through an MLP. Item tower: each
item's row of the class head, scored by cosine (``head.margin``) at a temperature
(``1 / head.scale``). The loss is the in-batch sampled softmax with the log-q correction
(``head: {kind: partial_fc, sample_rate: 0, sample_correction: true}``: each step's negatives
are the other rows' next items, gathered from every rank), and evaluation is recall@k (HR@k,
one target a row) over the full item corpus. Named in the config by import path
(``model: {_component_: towers:MeanTower, hidden: [128]}``): its keys are its signature's.
"""

import torch
from torch import nn


class MeanTower(nn.Module):
    def __init__(self, dim: int, hidden: tuple[int, ...] = (128,)):  # dim: given by embedtrain
        super().__init__()
        layers, width = [], dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*layers, nn.Linear(width, dim))

    def forward(self, x, mask=None, is_causal=True):  # x: [B, T, D] item and position embeddings
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        return self.mlp(x.cumsum(dim=1) / steps[:, None])
