"""Graphs: vectorised neighbour and link sampling over a memory-mappable CSR, index-only blocks."""

from embedtrain.graph.sampler import (
    LinkBatch,
    LinkSampler,
    NegativeSampling,
    NeighborSampler,
    SampledBlocks,
    SeedBatches,
    edge_batches,
    sage_forward,
)

__all__ = ["LinkBatch", "LinkSampler", "NegativeSampling", "NeighborSampler", "SampledBlocks",
           "SeedBatches", "edge_batches", "sage_forward"]
