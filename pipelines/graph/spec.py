"""The graph ingestion spec: ``kind: graph`` YAML (``configs/ingest/graph_edges.yaml``).

:func:`pipelines.kind_of` tells a graph spec from the others; :func:`load_spec` reads it
into a :class:`GraphIngestSpec` (through :mod:`embedtrain.config_io`: one-line errors naming the
file and key) and checks what spans keys. The job itself is :mod:`pipelines.graph.passes`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Optional


from embedtrain.config_io import ConfigError, config_field, load_dataclass
from embedtrain.graph.csr import Duplicates, SelfLoops
from embedtrain.graph.store import FeatureDtype
from pipelines.core.fields import InputFormat, ValueType

EXTENSIONS = {InputFormat.CSV: (".csv", ".tsv", ".txt"), InputFormat.PARQUET: (".parquet",)}


class MissingNodes(enum.Enum):
    """What happens to an edge whose endpoint is not in the node table."""

    ADD = "add"    # the endpoint becomes a node without features (zeros) or label (-1), counted
    DROP = "drop"  # the edge is dropped, counted


@dataclass
class EdgeTableSpec:
    """The edge list: its layout and which column is what."""

    format: InputFormat = InputFormat.CSV           # csv or parquet
    separator: Optional[str] = None                 # csv only (default ",")
    null_values: list[str] = field(default_factory=list)  # csv: extra null markers
    src: str = "src"                                # the source id column
    dst: str = "dst"                                # the destination id column
    weight: Optional[str] = None                    # positive weights; else unweighted
    edge_type: Optional[str] = None                 # a type column (rows counted by type)
    edge_types: Optional[list[str]] = None          # keep only these types (needs edge_type)
    timestamp: Optional[str] = None                 # numbers (e.g. Unix s) or dates: held-out
                                                    # edges are then the newest


@dataclass
class NodeTableSpec:
    """The node table (``--nodes``): ids, features and labels."""

    format: InputFormat = InputFormat.CSV           # csv or parquet
    separator: Optional[str] = None                 # csv only (default ",")
    null_values: list[str] = field(default_factory=list)  # csv: extra null markers
    id: str = "id"                                  # the node id column (as the edges' ids)
    features: list[str] = field(default_factory=list)  # float columns, or one list column
    # the features' type on disk: float32, or float16 (half the bytes; a value beyond +-65504
    # stops the job, naming its column and node)
    feature_dtype: FeatureDtype = FeatureDtype.FLOAT32
    # the label column, any type: the classes are its sorted distinct values (null: -1)
    label: Optional[str] = None
    # an edge endpoint that is not in the node table: add it, or drop the edge
    missing_nodes: MissingNodes = MissingNodes.ADD


@dataclass
class GraphShapeSpec:
    directed: bool = False  # false: each edge stored in both directions
    self_loops: SelfLoops = SelfLoops.DROP  # an edge from a node to itself: drop or keep
    duplicates: Duplicates = Duplicates.DROP  # an edge given more than once: drop, keep or sum
    # GiB the CSR build may sort in memory; an edge list needing more is sorted out of core
    # (embedtrain.graph.csr_external.csr_from_edge_chunks: the same CSR). None: a quarter of the RAM.
    memory_gb: Optional[float] = None


NODE_SPLITS = ("train", "valid", "test")


class SplitMethod(enum.Enum):
    """How nodes are put into the train/valid/test splits."""

    RANDOM = "random"  # valid_fraction / test_fraction of the labelled nodes (all without labels)
    COLUMN = "column"  # a column of the node table names each node's split (split.values)
    IDS = "ids"        # one id list per split (split.files: parquet, CSV or .npy)


@dataclass
class SplitFiles:
    """``method: ids``: one file of node ids per split (relative paths: to the spec's folder)."""

    train: Optional[str] = config_field(None, path=True)  # the train split's node ids
    valid: Optional[str] = config_field(None, path=True)  # the valid split's node ids
    test: Optional[str] = config_field(None, path=True)   # the test split's node ids


@dataclass
class GraphSplitSpec:
    """Node splits (node classification) and held-out edges (link prediction)."""

    method: SplitMethod = SplitMethod.RANDOM        # random, column or ids
    valid_fraction: float = 0.1                     # method: random
    test_fraction: float = 0.1                      # method: random
    column: Optional[str] = None                    # method: column: the node table's column,
    # its values per split (compared as text, numbers too; default train/valid/test)
    values: Optional[dict[str, list[str]]] = config_field(None, text=True)
    files: SplitFiles = field(default_factory=SplitFiles)  # method: ids
    id_column: Optional[str] = None                 # parquet/CSV id lists (default: nodes.id)
    # link prediction: shares of the distinct edges held out for valid and test (with
    # edges.timestamp, the newest; else drawn at random)
    edge_valid_fraction: float = 0.0
    edge_test_fraction: float = 0.0  # see edge_valid_fraction
    seed: int = 0  # of the random node split and the random held-out edges

    def split_values(self) -> dict[str, list[str]]:
        """``method: column``: the column's values of each split (absent splits: none)."""
        if self.values is None:
            return {k: [k] for k in NODE_SPLITS}
        return {k: list(self.values.get(k, [])) for k in NODE_SPLITS}


@dataclass
class GraphIngestSpec:
    """A whole graph ingestion job."""

    kind: str = "graph"  # this spec's family (pipelines.kind_of reads it)
    name: str = "graph"  # the data set's name (what a run prints)
    id_type: ValueType = ValueType.STRING  # ids are compared as strings or as integers
    edges: EdgeTableSpec = field(default_factory=EdgeTableSpec)
    nodes: Optional[NodeTableSpec] = None
    # directions, self-loops, duplicates and the CSR build's memory
    graph: GraphShapeSpec = field(default_factory=GraphShapeSpec)
    split: GraphSplitSpec = field(default_factory=GraphSplitSpec)



def load_spec(path: str | os.PathLike, overrides: Optional[list[str]] = None
                    ) -> GraphIngestSpec:
    """Reads and validates a graph ingestion spec.

    Args:
        path: the YAML file.
        overrides: ``key.path=value`` strings (``graph.directed=true``).

    Raises:
        ConfigError: one line naming the file and key path.

    Example:
        >>> load_spec("configs/ingest/graph_edges.yaml").graph.duplicates
        <Duplicates.DROP: 'drop'>
    """
    spec = load_dataclass(path, GraphIngestSpec, overrides)

    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{path}: {key}: {message}")

    if spec.kind != "graph":
        fail("kind", f"expected 'graph', got {spec.kind!r}")
    tables = [("edges", spec.edges)] + ([("nodes", spec.nodes)] if spec.nodes else [])
    for key, table in tables:
        if table.format not in EXTENSIONS:
            fail(f"{key}.format", f"must be csv or parquet, got {table.format.value}")
        if table.separator is not None and (table.format is not InputFormat.CSV
                                            or len(table.separator) != 1):
            fail(f"{key}.separator", "one character, for format: csv only")
    e = spec.edges
    columns = [c for c in (e.src, e.dst, e.weight, e.edge_type, e.timestamp) if c is not None]
    if len(set(columns)) != len(columns):
        fail("edges", f"a column is named twice: {columns}")
    if e.edge_types is not None and e.edge_type is None:
        fail("edges.edge_types", "needs edges.edge_type (the column holding the type)")
    if spec.nodes is not None:
        n = spec.nodes
        named = [n.id, *n.features, *([n.label] if n.label else [])]
        if spec.split.method is SplitMethod.COLUMN and spec.split.column:
            named.append(spec.split.column)
        if len(set(named)) != len(named):
            fail("nodes", f"a column is named twice: {named}")
        if n.feature_dtype is not FeatureDtype.FLOAT32 and not n.features:
            fail("nodes.feature_dtype", f"{n.feature_dtype.value} but nodes.features names no "
                 "feature columns")
    if spec.graph.memory_gb is not None and not spec.graph.memory_gb > 0:
        fail("graph.memory_gb", f"must be > 0 (GiB), got {spec.graph.memory_gb}")
    s = spec.split
    for key in ("valid_fraction", "test_fraction", "edge_valid_fraction", "edge_test_fraction"):
        if not 0 <= getattr(s, key) < 1:
            fail(f"split.{key}", f"must be in [0, 1), got {getattr(s, key)}")
    if s.valid_fraction + s.test_fraction >= 1:
        fail("split.test_fraction", "valid_fraction + test_fraction must be < 1")
    if s.edge_valid_fraction + s.edge_test_fraction >= 1:
        fail("split.edge_test_fraction", "edge_valid_fraction + edge_test_fraction must be < 1")
    files = {k: getattr(s.files, k) for k in NODE_SPLITS if getattr(s.files, k)}
    if s.method is not SplitMethod.COLUMN:
        for key in ("column", "values"):
            if getattr(s, key) is not None:
                fail(f"split.{key}", f"only for split.method: column (method is {s.method.value})")
    if s.method is not SplitMethod.IDS:
        for key in [f"files.{k}" for k in files] + (["id_column"] if s.id_column else []):
            fail(f"split.{key}", f"only for split.method: ids (method is {s.method.value})")
    if s.method is SplitMethod.COLUMN:
        if spec.nodes is None:
            fail("split.method", "column needs a nodes: section (the table holding the column)")
        if not s.column:
            fail("split.column", "method: column needs the node table's split column")
        unknown = sorted(set(s.values or {}) - set(NODE_SPLITS))
        if unknown:
            fail(f"split.values.{unknown[0]}", "not a split; the splits are train, valid, test")
        owner: dict[str, str] = {}
        for split, values in s.split_values().items():
            for v in values:
                if v in owner and owner[v] != split:
                    fail(f"split.values.{split}", f"value {v!r} is also listed under {owner[v]}")
                owner[v] = split
    if s.method is SplitMethod.IDS:
        if not files:
            fail("split.files", "method: ids needs at least one of train, valid, test (id files)")
        for k, f in files.items():
            if not f.endswith(ID_FILE_EXTENSIONS):
                fail(f"split.files.{k}", f"{f}: expected a {', '.join(ID_FILE_EXTENSIONS)} file")
    return spec


ID_FILE_EXTENSIONS = (".parquet", ".csv", ".tsv", ".txt", ".npy")
