"""A task of one's own: a rating predicted with the Huber loss (squared near the target, linear
beyond ``delta``, so a few wild ratings do not dominate), scored by MAE and RMSE.

Named in the config by import path (``task: {_component_: huber:HuberRegression, delta: 1.0}``):
its keys are its signature's. It runs on the CTR family's data and model (``family``), and its
model's output is served as the rating itself (``score: identity``).
"""

import torch.nn.functional as F
from torchmetrics import MeanAbsoluteError, MeanSquaredError

import embedtrain as et


class HuberRegression:
    name, main_metric, family, score = "huber", "mae", "ctr", "identity"

    def __init__(self, delta: float = 1.0):
        self.delta = delta

    def forward(self, model, batch):  # model.training tells training from evaluation
        out = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        n = len(out) - et.num_padding(batch)  # padding rows (the epoch's last step) come last
        loss = F.huber_loss(out[:n], batch.labels[:n], delta=self.delta) if n else out.sum() * 0
        return et.StepOutput(loss=loss, predictions=out[:n].detach(), num_examples=n)

    def new_metrics(self):
        return Metrics()


class Metrics:
    def __init__(self):
        self.mae, self.mse = MeanAbsoluteError(), MeanSquaredError()

    def update(self, output, batch):
        labels = batch.labels[: output.num_examples]
        self.mae.update(output.predictions, labels)
        self.mse.update(output.predictions, labels)

    def compute(self):  # torchmetrics' states: synced over ranks here
        return {"mae": float(self.mae.compute()), "rmse": float(self.mse.compute()) ** 0.5}
