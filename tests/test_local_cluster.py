"""The cluster a run without a cluster file plans on (``recipes.base.local_cluster``).

On CPU every sharding type a plan uses costs a step its own input dist, TBE calls and output
dist (about 2 ms even in a world of one, ``benchmarks/bench_roofline.py``). With that cost at 0
the planner split the demo's tables over table_wise and row_wise on a single rank, where
row_wise buys nothing: two sharding groups, ~5 ms more per step than one.
"""

import dataclasses

import pytest
import torch
from torchrec import EmbeddingBagCollection

from embedtrain.recipes.base import local_cluster
from embedtrain.sharding.planner import plan_sharding
from embedtrain.testing import random_embedding_tables
from embedtrain.train.optim import fuse_sparse_optimizer
from embedtrain.train.options import SparseOptimizer

pytestmark = pytest.mark.usefixtures("quiet_torchrec")


def demo_like_tables() -> torch.nn.Module:
    """26 tables of dim 16, 3 to 200,000 rows (the demo's sizes), fused row-wise Adagrad."""
    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(
        tables=random_embedding_tables(26, seed=0, log10_rows=(0.5, 5.3), dims=(16,)),
        device=torch.device("meta"))
    fuse_sparse_optimizer(model, SparseOptimizer.ROWWISE_ADAGRAD, 0.05)
    return model


def sharding_types(model: torch.nn.Module, cluster) -> set[str]:
    return {t.sharding_type for t in plan_sharding(model, cluster).report.tables}


@pytest.mark.parametrize("world", [1, 2])
def test_local_cpu_plan_uses_one_sharding_group(world):
    model = demo_like_tables()
    cluster = local_cluster(world, torch.device("cpu"), 2048 // world)
    assert len(sharding_types(model, cluster)) == 1
    # what the group cost guards against: free groups, and the same tables are split over two
    free = dataclasses.replace(cluster, sharding_group_ms=0.0)
    assert len(sharding_types(model, free)) > 1
