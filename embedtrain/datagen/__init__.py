"""Deterministic synthetic data sets with planted models (``embedtrain datagen``), torch-free.

- :mod:`embedtrain.datagen.ctr`: Criteo-layout CTR parquet with a planted click model and the
  oracle AUC / log loss (:func:`generate_ctr`);
- :mod:`embedtrain.datagen.tsv`: the same CTR rows as raw Criteo-style TSV logs, what
  ``embedtrain ingest`` starts from (:func:`generate_ctr_tsv`);
- :mod:`embedtrain.datagen.drift`: a drifting CTR data set with raw int64 ids that are born and
  die over time periods, split by time, so that offline vocabularies go stale
  (:func:`generate_ctr_drift`, ``embedtrain datagen ctr --drift``);
- :mod:`embedtrain.datagen.xc`: extreme classification with the Bayes-optimal P@k
  (:func:`generate_xc`);
- :mod:`embedtrain.datagen.graph`: a degree-corrected block model graph with the Bayes
  accuracies (:func:`generate_graph`), its node features Gaussian or bags of words
  (:mod:`embedtrain.datagen.graph_words`);
- :mod:`embedtrain.datagen.seq`: sequential recommendation (users' item sequences, leave-last-out
  splits, optionally the raw event log) with the Bayes-optimal HR@10 / NDCG@10
  (:func:`generate_seq`).

The functions write into the folder they are given. ``embedtrain datagen`` gives them a
temporary folder beside ``--out`` that replaces ``--out`` only once complete
(:func:`pipelines.atomic_output`, see :mod:`embedtrain.cli.datagen`): a failed or killed run there
leaves the earlier data set as it was.

Nothing here imports torch or torchrec (only NumPy, PyArrow and the graph store), so generating
data needs neither; a test checks it.

Example:
    >>> from embedtrain.datagen import CTRDataSpec, generate_ctr
    >>> meta = generate_ctr(CTRDataSpec(rows=20_000, seed=1), "/tmp/ctr", progress=False)
"""

from embedtrain.datagen.ctr import CTRDataSpec, generate_ctr
from embedtrain.datagen.drift import DriftDataSpec, generate_ctr_drift
from embedtrain.datagen.graph import GraphDataSpec, generate_graph
from embedtrain.datagen.seq import SeqDataSpec, generate_seq
from embedtrain.datagen.tsv import generate_ctr_tsv
from embedtrain.datagen.xc import XCDataSpec, generate_xc

__all__ = ["CTRDataSpec", "DriftDataSpec", "GraphDataSpec", "SeqDataSpec", "XCDataSpec",
           "generate_ctr", "generate_ctr_drift", "generate_ctr_tsv", "generate_graph",
           "generate_seq", "generate_xc"]
