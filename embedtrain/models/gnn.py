"""GraphSAGE (or GCN, GAT) over sampled neighbourhoods, with node-id embeddings in a TorchRec table.

Every node of a sampled subgraph (``SampledBlocks.n_id``) looks up its row of the node-id table
``t_node`` (an ``EmbeddingBagCollection`` with one id per bag, so TorchRec shards it like DLRM's
tables and updates it with a fused optimizer); the row is concatenated with the node's features
and the GraphSAGE layers (PyG ``SAGEConv``) run from the outermost hop in, each layer keeping only
the nodes the next one needs (PyG's trim-to-layer), so the last layer's rows are the seed nodes.

The inputs are explicit: the blocks of :class:`~embedtrain.graph.sampler.NeighborSampler`, the
node ids as a ``KeyedJaggedTensor`` of key :data:`NODE_FEATURE` (one id per node of ``n_id``,
possibly padded with empty bags), and the nodes' features.

Every node's output without sampling -- each layer over all nodes in chunks, with full
neighbourhoods -- is :func:`embedtrain.models.layerwise.layerwise_inference`; it runs the same
:meth:`GraphSAGE.layer` as :meth:`GraphSAGE.forward`.

Example:
    >>> model = GraphSAGE(num_nodes=1_000_000, num_features=32, embedding_dim=32,
    ...                   hidden=[128, 128], out_dim=16, aggr=Aggregation.MEAN)
    >>> logits = model(batch.blocks, batch.node_ids, batch.features)  # [num_seeds, out_dim]
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import tempfile
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.dependencies import import_optional
from embedtrain.graph.sampler import SampledBlocks
from embedtrain.tables.dynamic import embedding_bags
from embedtrain.models.options import Aggregation, DynamicTable, GNNModel

NODE_TABLE = "t_node"
NODE_FEATURE = "node"


class GraphSAGE(nn.Module):
    """Node-id embeddings + features -> ``len(hidden)`` SAGEConv layers -> a linear output.

    Args:
        num_nodes: rows of the node-id table (0: no table, features only).
        num_features: node feature width (0: none).
        embedding_dim: node-id table width.
        hidden: SAGEConv output sizes, one per hop (outermost first is the first layer).
        out_dim: classes (node classification) or the embedding size (link prediction).
        aggr: SAGEConv aggregation of the neighbours' messages.
        dropout: between layers.
        device: of the table (``meta`` for planning or sharding).
        kind: :attr:`GNNModel.SAGE`; :attr:`GNNModel.GCN` (PyG ``GCNConv`` over the node and
            its neighbours with weights ``1 / (degree + 1)``: Kipf & Welling's layer with the
            mean normalisation ``D^-1 (A + I)``, since a sampled block knows its targets'
            degrees, not its sources'); :attr:`GNNModel.GAT` (PyG ``GATConv``, ``heads`` heads
            concatenated, self-loops added); or :attr:`GNNModel.MLP` to make the layers plain
            linear ones on each seed node alone (an MLP on its id embedding and features): the
            baseline that shows what the graph adds. GCN, GAT and APPNP take a node's own row
            as its self-loop: the targets must be the first rows of the sources (the sampler's
            blocks are; layer-wise inference orders its chunks so).
            :attr:`GNNModel.APPNP`: predict, then propagate (Klicpera et al., ICLR 2019): the
            layers run on each node alone (an MLP, with dropout on its input too), then each hop
            is a step of personalised-PageRank propagation without weights, ``z <- (1 - alpha)
            * mean(z over the node and its neighbours) + alpha * h`` (``h``: the node's MLP
            output), and ``out`` scores ``z``; ``hops`` steps, any number of layers. Its
            layers carry ``[z | h]`` from hop to hop. Propagating before the linear ``out``
            equals propagating its outputs, since each step's weights sum to 1.
        heads: GAT's attention heads (each hidden size divisible by it).
        hops: the APPNP kind's propagation steps (the sampler's hops); the other kinds have one
            layer a hop.
        alpha: the APPNP kind's teleport probability.
        dynamic: make the node-id table dynamic (:mod:`embedtrain.tables.dynamic`): its
            ``capacity`` rows for the nodes looked up most recently (or often), not one per node.
    """

    def __init__(self, num_nodes: int, num_features: int, embedding_dim: int,
                 hidden: Sequence[int], out_dim: int, aggr: Aggregation = Aggregation.MEAN,
                 dropout: float = 0.0, device: Optional[torch.device] = None,
                 kind: GNNModel = GNNModel.SAGE, dynamic: Optional[DynamicTable] = None,
                 heads: int = 4, hops: Optional[int] = None, alpha: float = 0.1) -> None:
        super().__init__()
        pyg = import_optional("torch_geometric.nn", "torch-geometric", "GNN models")

        if not hidden:
            raise ValueError("gnn.hidden: needs one size per sampled hop")
        if not isinstance(aggr, Aggregation) or not isinstance(kind, GNNModel):
            raise TypeError(f"aggr must be an Aggregation and kind a GNNModel, got {aggr!r} and "
                            f"{kind!r}")
        if num_nodes <= 0 and num_features <= 0:
            raise ValueError("gnn.embedding_dim: the graph has no node features, so the model "
                             "needs a node-id table: set it above 0 (e.g. 32)")
        self.ebc = None
        if num_nodes > 0 and embedding_dim > 0:
            rows = dynamic.capacity if dynamic is not None else num_nodes
            self.ebc = embedding_bags([EmbeddingBagConfig(
                name=NODE_TABLE, embedding_dim=embedding_dim, num_embeddings=rows,
                feature_names=[NODE_FEATURE], pooling=PoolingType.SUM)],
                {NODE_TABLE: dynamic} if dynamic is not None else None, device)
        width = num_features + (embedding_dim if self.ebc is not None else 0)
        self.num_features, self.input_width = num_features, width
        convs = []
        with _generated_sources_removed():  # PyG writes code for each conv class into TMPDIR
            for i, size in enumerate(hidden):
                if kind is GNNModel.SAGE:
                    convs.append(pyg.SAGEConv(width, size, aggr=aggr.value))
                elif kind is GNNModel.GCN:
                    convs.append(pyg.GCNConv(width, size, add_self_loops=False, normalize=False))
                elif kind is GNNModel.GAT:
                    if size % heads:
                        raise ValueError(f"gnn.hidden[{i}]: {size} is not divisible by "
                                         f"gnn.heads ({heads})")
                    convs.append(pyg.GATConv(width, size // heads, heads=heads))
                else:
                    convs.append(nn.Linear(width, size))
                width = size
        self.kind, self.hidden = kind, list(hidden)
        self.convs = nn.ModuleList(convs)
        self.out = nn.Linear(width, out_dim)
        self.dropout = dropout
        self.alpha = alpha
        self.num_layers = len(convs)  # the layer() calls: one a hop
        self.layer_widths = list(hidden)  # each layer's output width
        if kind is GNNModel.APPNP:
            self.num_layers = len(hidden) if hops is None else hops
            if self.num_layers < 1 or not 0.0 <= alpha <= 1.0:
                raise ValueError(f"appnp: needs at least one hop and alpha in [0, 1], got "
                                 f"{self.num_layers} and {alpha}")
            self.layer_widths = [2 * width] * (self.num_layers - 1) + [width]  # [z | h], then z

    def forward(self, blocks: SampledBlocks, node_ids: Optional[KeyedJaggedTensor] = None,
                features: Optional[Tensor] = None) -> Tensor:
        """The seeds' outputs.

        Args:
            blocks: the sampled subgraph (``n_id``: the seeds first; one ``edge_index`` per hop).
            node_ids: the node-id table's input: key :data:`NODE_FEATURE`, one id per node of
                ``blocks.n_id`` in that order, then any padding (empty bags); needed when the
                model has a table.
            features: float ``[len(blocks.n_id), F]`` node features in ``n_id`` order, or None.

        Returns:
            ``[blocks.num_seeds, out_dim]``.
        """
        embeddings = None
        if self.ebc is not None:
            if node_ids is None:
                raise ValueError("GraphSAGE has a node-id table: pass node_ids")
            embeddings = self.ebc(node_ids).values()[: blocks.n_id.numel()]
        x = self.node_inputs(embeddings, features)
        if self.kind is GNNModel.MLP:
            x = x[: blocks.num_seeds]
            for i in range(len(self.convs)):
                x = self.layer(i, x)
            return self.out(x)
        hops = len(blocks.edge_index)
        if hops != self.num_layers:
            raise ValueError(f"the sampler draws {hops} hop(s) but the model has "
                             f"{self.num_layers} layer(s) a hop: " + (
                                 "build it with hops=len(fanouts)" if self.kind is GNNModel.APPNP
                                 else "gnn.fanouts and gnn.hidden must have the same length"))
        for i in range(self.num_layers):
            # Layer i updates the nodes within hops - i - 1 of the seeds from their sampled
            # neighbours: edge_index[h - 1] holds the edges of hops 1 .. h (trim-to-layer).
            h = hops - i
            n_src, n_dst = blocks.num_nodes_per_hop[h], blocks.num_nodes_per_hop[h - 1]
            x = self.layer(i, (x[:n_src], x[:n_dst]), blocks.edge_index[h - 1])
        return self.out(x[: blocks.num_seeds])

    def node_inputs(self, embeddings: Optional[Tensor], features: Optional[Tensor]) -> Tensor:
        """The first layer's input rows: ``[id embedding | features]``.

        Args:
            embeddings: ``[n, embedding_dim]`` rows of the node-id table, or None (no table).
            features: ``[n, F]`` node features, or None (or 0 columns: none).

        Returns:
            ``[n, input_width]``.
        """
        parts = [] if embeddings is None else [embeddings]
        if features is not None and features.shape[1]:
            parts.append(features)
        if not parts:
            raise ValueError("GraphSAGE: no input: the model has neither a node-id table nor "
                             "node features")
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def embed_nodes(self, ids: Tensor) -> Tensor:
        """The node-id table's rows of ``ids`` through the model's own (unsharded) table; a
        dynamic table maps the ids as evaluation does (in eval mode, nothing is admitted).

        Args:
            ids: int64 ``[n]`` node ids.

        Returns:
            float ``[n, embedding_dim]``.

        Example:
            >>> model.embed_nodes(torch.arange(4)).shape
            torch.Size([4, 32])
        """
        if self.ebc is None:
            raise ValueError("GraphSAGE has no node-id table (gnn.embedding_dim: 0)")
        ids = ids.long()
        kjt = KeyedJaggedTensor(keys=[NODE_FEATURE], values=ids,
                                lengths=torch.ones(ids.numel(), dtype=torch.int32),
                                stride=ids.numel())
        return self.ebc(kjt).values()

    def layer(self, i: int, x: Tensor | tuple[Tensor, Tensor],
              edge_index: Optional[Tensor] = None) -> Tensor:
        """Layer ``i`` (``SAGEConv``, or the MLP kind's ``Linear`` on the targets alone), then,
        but after the last layer, ReLU and dropout (in training mode): what :meth:`forward`
        runs per hop, and layer-wise inference (:mod:`embedtrain.models.layerwise`) per chunk.

        Args:
            i: the layer, ``0 .. len(convs) - 1``.
            x: ``(x_src, x_dst)``: the message sources' rows and the targets' rows (one tensor:
                both).
            edge_index: ``[2, E]`` local ids (row 0 into ``x_src``, row 1 into ``x_dst``); the
                MLP kind takes none.

        Returns:
            ``[len(x_dst), layer_widths[i]]``.
        """
        if self.kind is GNNModel.APPNP:
            return self._propagate(i, x, edge_index)
        if self.kind is GNNModel.MLP:
            x = self.convs[i](x[1] if isinstance(x, tuple) else x)
        elif self.kind is GNNModel.GCN:  # the mean over the target and its neighbours
            x_src, x_dst = x if isinstance(x, tuple) else (x, x)
            edges, degree = _with_self_loops(edge_index, len(x_dst))
            weight = 1.0 / degree.to(x_src.dtype)
            x = self.convs[i](x_src, edges, weight[edges[1]])[: len(x_dst)]
        else:
            x = self.convs[i](x, edge_index)
        if i < len(self.convs) - 1:
            x = nn.functional.dropout(torch.relu(x), self.dropout, self.training)
        return x

    def _propagate(self, i: int, x: Tensor | tuple[Tensor, Tensor],
                   edge_index: Tensor) -> Tensor:
        """The APPNP kind's hop ``i``: layer 0 runs the MLP on every source (the targets are
        the first sources), the others read ``[z | h]``; then one propagation step to the
        targets, over each target and its neighbours."""
        x_src, x_dst = x if isinstance(x, tuple) else (x, x)
        if i == 0:
            h = nn.functional.dropout(x_src, self.dropout, self.training)
            for conv in self.convs:
                h = nn.functional.dropout(torch.relu(conv(h)), self.dropout, self.training)
            z = h
        else:
            z, h = x_src.chunk(2, dim=1)
        n = len(x_dst)
        edges, degree = _with_self_loops(edge_index, n)
        scatter = import_optional("torch_geometric.utils", "torch-geometric", "GNN models").scatter
        total = scatter(z.index_select(0, edges[0]), edges[1], 0, n, reduce="sum")
        z = (1.0 - self.alpha) * total / degree.unsqueeze(1) + self.alpha * h[:n]
        return z if i == self.num_layers - 1 else torch.cat([z, h[:n]], dim=1)


def _with_self_loops(edge_index: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``edge_index`` with a self-loop ``(i, i)`` for each of the ``n`` targets (the targets
    are the first sources), and each target's degree counting it (at least 1)."""
    edges = torch.cat([edge_index, torch.arange(n).expand(2, -1)], dim=1)
    return edges, torch.bincount(edges[1], minlength=n)


@contextlib.contextmanager
def _generated_sources_removed() -> Iterator[None]:
    """Removes the source files PyG generates while the ``with`` body builds conv layers.

    PyG's ``MessagePassing`` compiles ``propagate`` (and ``edge_updater``) of each conv class
    from Jinja templates, once per process: ``torch_geometric.template.module_from_template``
    writes the code to ``$TMPDIR/<module>_XXXXXXXX.py`` (``delete=False``), imports it and never
    removes the file, so every GNN process left one file per conv class in TMPDIR. The module is
    in memory once imported; its lines go into ``linecache`` (kept: no mtime to check), so
    tracebacks and ``inspect.getsource`` (TorchScript) still show it, and the file is deleted.
    Only those files are touched: a module that appeared during the body, named
    ``torch_geometric.*``, whose file is ``<its name>_*.py`` right in TMPDIR."""
    before = set(sys.modules)
    try:
        yield
    finally:
        tmp = os.path.realpath(tempfile.gettempdir())
        for name in set(sys.modules) - before:
            path = getattr(sys.modules.get(name), "__file__", None)
            if not (name.startswith("torch_geometric.") and isinstance(path, str)):
                continue
            base = os.path.basename(path)
            if (os.path.dirname(os.path.realpath(path)) != tmp
                    or not (base.startswith(f"{name}_") and base.endswith(".py"))):
                continue
            with contextlib.suppress(OSError, UnicodeDecodeError):
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                linecache.cache[path] = (len(text), None, text.splitlines(keepends=True), path)
                os.unlink(path)
