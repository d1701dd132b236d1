"""``bench_graph_scale.py``'s step 5: layer-wise inference of a trained GNN run on a sample.

:func:`infer` rebuilds the run's model on CPU from its last checkpoint
(:func:`embedtrain.export.nodes.load_graph_model`) and computes the final outputs of ``n`` random
nodes layer by layer with full neighbourhoods (:func:`embedtrain.models.layerwise.
layerwise_inference`: only the rows those nodes need, intermediate layers memory-mapped in the
run folder when large), timed; with labels, the accuracy of its argmax on the sample.

Example:
    >>> infer("/tmp/run", "/tmp/graph", 100_000)  # doctest: +SKIP
    {'nodes': 100000, 'seconds': 41.2, 'nodes_per_s': 2427.2, 'accuracy': 0.91}
"""

from __future__ import annotations

import time

import numpy as np


def infer(run_dir: str, graph_dir: str, n: int, seed: int = 0) -> dict:
    """Layer-wise inference of ``n`` random nodes of the run's graph (see the module docstring)."""
    from embedtrain.export.nodes import load_graph_model
    from embedtrain.models.layerwise import layerwise_inference

    model, graph = load_graph_model(run_dir, table_dir=run_dir)  # a node table memory-mapped
    n = min(n, graph.num_nodes)
    nodes = np.sort(np.random.default_rng(seed).choice(graph.num_nodes, n, replace=False))
    start = time.perf_counter()
    out = layerwise_inference(model, graph, nodes=nodes, keep_embeddings=False,
                              scratch_dir=run_dir)
    seconds = time.perf_counter() - start
    result = {"nodes": n, "seconds": round(seconds, 2), "nodes_per_s": round(n / seconds, 1)}
    if graph.labels is not None:
        labels = np.asarray(graph.labels[out.nodes])
        known = labels >= 0
        pred = np.asarray(out.outputs).argmax(axis=1)
        result["accuracy"] = round(float((pred[known] == labels[known]).mean()), 4)
    return result
