"""The built-in tasks, by the names a config gives them: ``task: {_component_:
embedtrain.tasks:Regression}``. A task owns its loss, predictions and metrics
(:class:`~embedtrain.train.task.Task`); its class's ``family`` names the data and model it runs
on, and a task of one's own is a class by import path the same way.
"""

from embedtrain.train.ctr import CTRTask as BinaryClassification
from embedtrain.train.ctr import Regression
from embedtrain.train.gnn import LinkPredictionTask as LinkPrediction
from embedtrain.train.gnn import NodeClassificationTask as NodeClassification
from embedtrain.train.retrieval import Retrieval
from embedtrain.train.seq import SeqTask as NextItem
from embedtrain.train.xc import XCTask as ExtremeClassification

__all__ = ["BinaryClassification", "ExtremeClassification", "LinkPrediction", "NextItem",
           "NodeClassification", "Regression", "Retrieval"]
