"""DLRM / DCNv2 built from feature specs: shapes, gradients, and DMP (one rank) vs unsharded."""

import copy

import pytest
import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel

from embedtrain.data.reader import ParquetBatchReader
from embedtrain.models.dlrm import dcn, dlrm
from embedtrain.testing import random_ctr_table, write_parquet
from embedtrain.train.dist import init_process_group


@pytest.fixture(scope="module")
def batch_and_spec(tmp_path_factory):
    table, spec = random_ctr_table(rows=64, seed=0)
    f = write_parquet(table, tmp_path_factory.mktemp("m") / "t.parquet")
    return next(iter(ParquetBatchReader([f], spec, 64))), spec


@pytest.mark.parametrize("builder", [dlrm, dcn])
def test_forward_backward_shapes(batch_and_spec, builder):
    batch, spec = batch_and_spec
    torch.manual_seed(0)
    model = builder(spec, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (64, 1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), batch.labels).backward()
    tables = model.sparse_arch.embedding_bag_collection.embedding_bags
    assert [t.weight.shape[0] for t in tables.values()] == [f.num_embeddings for f in spec.sparse]
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    # only rows looked up by the batch receive gradient
    used = set(batch.sparse_features["s0"].values().tolist())
    grad_rows = set(torch.nonzero(tables["t_s0"].weight.grad.abs().sum(1)).flatten().tolist())
    assert grad_rows == used


def test_the_mlps_ends_are_derived(batch_and_spec):
    # the bottom MLP ends at embedding_dim, the top one at the logit: appended where missing,
    # a list that ends there already means what it did
    _, spec = batch_and_spec

    def sizes(model):
        return ([m.out_features for m in model.dense_arch.modules() if isinstance(m, nn.Linear)],
                [m.out_features for m in model.over_arch.modules() if isinstance(m, nn.Linear)])

    assert sizes(dlrm(spec, embedding_dim=8, bottom_mlp=[16, 4], top_mlp=[4, 2])) == (
        [16, 4, 8], [4, 2, 1])
    assert sizes(dlrm(spec, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[4, 1])) == (
        [16, 8], [4, 1])
    assert sizes(dlrm(spec, embedding_dim=8, bottom_mlp=[], top_mlp=[4])) == ([8], [4, 1])


def test_dmp_one_rank_matches_unsharded(batch_and_spec):
    batch, spec = batch_and_spec
    init_process_group()
    torch.manual_seed(0)
    model = dlrm(spec, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
    reference = copy.deepcopy(model)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    dmp.load_state_dict(reference.state_dict())  # same weights, now in FBGEMM's sharded tables
    torch.testing.assert_close(
        dmp(batch.dense_features, batch.sparse_features),
        reference(batch.dense_features, batch.sparse_features),
    )
