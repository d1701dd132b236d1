"""Graphs: the on-disk CSR data set, vectorised neighbour and link sampling, GNN batches.

The data flow, in PyG's split: :mod:`~embedtrain.graph.csr` builds a CSR from edges and
:mod:`~embedtrain.graph.store` writes and loads it (:class:`GraphData`); a loader
(:mod:`~embedtrain.graph.loader`: :class:`SeedBatches`, :func:`node_loader`, :func:`link_loader`)
splits the seeds of each rank into batches and calls a collate (:mod:`~embedtrain.graph.batch`)
that runs the samplers (:mod:`~embedtrain.graph.link` for link pairs,
:mod:`~embedtrain.graph.sampler` for the neighbourhood) and then attaches the features and
targets (:class:`GraphBatch`). :mod:`~embedtrain.graph.csr_external` builds a CSR larger than
memory. (Layer-wise full-graph inference, which runs a trained GraphSAGE over these arrays, is a
model's: :mod:`embedtrain.models.layerwise`.)

The names below load on first use, so that ``embedtrain.graph.types`` (imported by the config
schema) imports no torch.
"""

from embedtrain.utils import lazy_exports

_EXPORTS = {
    **{name: "embedtrain.graph.csr" for name in (
        "Duplicates", "EdgeCounts", "SelfLoops", "csr_from_edges", "edge_pairs",
        "hold_out_edges", "row_blocks")},
    **{name: "embedtrain.graph.csr_external" for name in (
        "ScratchDir", "csr_from_edge_chunks", "memory_budget")},
    **{name: "embedtrain.graph.store" for name in ("GraphData", "load_graph", "write_graph")},
    **{name: "embedtrain.graph.sampler" for name in ("NeighborSampler", "SampledBlocks")},
    **{name: "embedtrain.graph.link" for name in ("LinkBatch", "LinkSampler")},
    **{name: "embedtrain.graph.batch" for name in (
        "GraphBatch", "gather_rows", "link_batch", "node_batch", "node_features")},
    **{name: "embedtrain.graph.loader" for name in ("SeedBatches", "link_loader", "node_loader")},
    "NegativeSampling": "embedtrain.graph.types",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
