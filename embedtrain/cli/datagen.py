"""``embedtrain datagen``: synthetic CTR (parquet or raw TSV, optionally drifting), XC, graph and
sequential-recommendation data sets with their planted models (``embedtrain.datagen``,
torch-free).

Every kind is written into a temporary folder beside ``--out`` that replaces ``--out`` only when
complete (:func:`pipelines.atomic_output`, as for ``embedtrain ingest``): a failed or killed run
leaves ``--out`` as it was, and the next one removes a killed one's leftovers (one line). An
earlier datagen output at ``--out`` is replaced; a folder holding anything else, a file, or a
path under a file is refused in one line (exit status 2), as is a full disk (naming ``--out``).
``datagen seq --events DIR`` writes the raw event log the same way: into ``--out`` itself when
``DIR`` is ``--out``, else into a folder of its own (``events/`` plus a ``datagen.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from embedtrain.cli.errors import UsageError

# what datagen writes at the top of --out: name -> whether it is a folder (of data files), or
# the pattern of its files
DATAGEN_ENTRIES = {"metadata.json": False, "metadata.json.tmp": False, "datagen.json": False,
                   "train": True, "valid": True, "test": True, "graph": True, "nodes": True,
                   "splits": True, "items.parquet": False, "items.parquet.tmp": False,
                   "events": r"part-\d{5}\.(parquet|csv)(\.tmp)?"}  # datagen seq --events
TSV_PARTS = r"part-\d{5}\.tsv"
SEQ_MIXTURE = ("successor_prob", "interest_prob", "global_prob", "successor_locality")


def datagen_refusal(out: Path) -> Optional[str]:
    """Why datagen may not replace the existing non-empty folder ``out``, or None (it holds only
    what a datagen run writes)."""
    from pipelines import foreign_entries

    foreign = foreign_entries(out, {**DATAGEN_ENTRIES, "partitions.json": False},
                              files=[TSV_PARTS])
    # day partitions (ctr --drift --days): folders each holding what a datagen run writes
    foreign = [f for f in foreign if not (re.fullmatch(r"day=\d{3,}/", f)
                                          and not foreign_entries(out / f, DATAGEN_ENTRIES))]
    if foreign:
        return (f"not empty and not an earlier datagen output ({', '.join(foreign[:5])}); "
                "choose another --out")
    return None


@contextlib.contextmanager
def writing(out: str, complete: str = "metadata.json") -> Iterator[str]:
    """The temporary folder to generate into; it replaces ``out`` when the block ends normally."""
    from pipelines import atomic_output

    with atomic_output(out, datagen_refusal, job="datagen", complete=(complete,)) as staging:
        yield str(staging.path)


def register(sub) -> None:
    """Adds the ``datagen`` command to the subparsers ``sub``."""
    p = sub.add_parser("datagen", help="generate a synthetic data set")
    gen = p.add_subparsers(dest="kind", required=True)
    g = gen.add_parser("ctr", help="Criteo-layout CTR data with a planted click model")
    g.add_argument("--rows", type=int, default=1_000_000, help="total rows (default: 1,000,000)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--format", choices=["parquet", "tsv"], default="parquet",
                   help="parquet: a split, training-ready data set (default); tsv: the same rows "
                        "as raw Criteo-style TSV logs, for `embedtrain ingest`")
    # Not argparse's choices: a bad value is then one line naming the option, as for --rows.
    g.add_argument("--structure", default="criteo", metavar="{criteo,fm}",
                   help="the planted click model: criteo (default) mixes dense, per-id, "
                        "pairwise-table and multi-hot terms; fm is shaped like user-item logs: "
                        "per-id biases on 8 fields plus rank-8 latent-factor interactions "
                        "between 3 user-like and 3 item-like fields, on ids frequent enough to "
                        "learn from ~1M rows (the same schema and files)")
    g.add_argument("--drift", action="store_true",
                   help="a drifting data set instead: raw int64 ids born and dying over time "
                        "periods, split by time (embedtrain.datagen.drift)")
    g.add_argument("--drift-periods", type=int, metavar="N",
                   help="with --drift: time periods (default 20; train 80%%, valid, test 10%%)")
    g.add_argument("--days", type=int, metavar="N",
                   help="with --drift: N day partitions (OUT/day=001/ ...), one period a day, "
                        "each a data set of one train split: what continual training reads")
    g.add_argument("--drift-lifetime", type=int, metavar="N",
                   help="with --drift: periods an id stays alive (default 4)")
    g.add_argument("--drift-new-ids", type=int, metavar="N",
                   help="with --drift: new ids per period and feature, before the per-feature "
                        "scale (default 2000)")
    g = gen.add_parser("xc", help="extreme-classification data: Zipfian classes with planted "
                                  "token prototypes, and the Bayes-optimal P@1")
    g.add_argument("--classes", type=int, default=100_000, help="number of classes C")
    g.add_argument("--rows", type=int, default=1_000_000, help="total rows (default: 1,000,000)")
    g.add_argument("--vocab", type=int, default=200_000, help="token vocabulary size")
    g.add_argument("--noise", type=float, default=0.8,
                   help="share of a row's tokens drawn from the background (default 0.8)")
    g.add_argument("--multi-label", action="store_true",
                   help="rows carry 1..4 labels (a list column `labels`)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    g = gen.add_parser("graph", help="a graph with planted communities (degree-corrected SBM) "
                                     "that set the labels, and weakly informative features")
    g.add_argument("--nodes", type=int, default=100_000, help="number of nodes N")
    g.add_argument("--avg-degree", type=float, default=10.0, help="expected neighbours per node")
    g.add_argument("--edges", type=int, default=None,
                   help="undirected edges drawn, instead of --avg-degree (= 2 * edges / nodes)")
    g.add_argument("--memory-gb", type=float, default=None,
                   help="GiB the CSR build may sort in memory (default: a quarter of the RAM); a "
                        "bigger graph is drawn in chunks and built out of core: the same files")
    g.add_argument("--communities", type=int, default=16, help="communities = classes")
    g.add_argument("--feature-dim", type=int, default=None,
                   help="node feature dimension of the gaussian features (default 32)")
    # Not argparse's choices: a bad value is then one line naming the option.
    g.add_argument("--features", default="gaussian", metavar="{gaussian,bow}",
                   help="gaussian (default): dense features, the class mean plus noise; bow: "
                        "sparse bag-of-words rows as in a citation graph (--vocab 0/1 columns, "
                        "--words-per-node distinct words a node from a mix of a common "
                        "background and the community's topic words)")
    g.add_argument("--vocab", type=int, default=None,
                   help="with --features bow: words in the vocabulary (default 1433)")
    g.add_argument("--words-per-node", type=int, default=None,
                   help="with --features bow: distinct words of every node (default 18)")
    g.add_argument("--topic-share", type=float, default=None,
                   help="with --features bow: share of a community's word weight on its topic "
                        "words, the rest on the common background (default 0.15)")
    g.add_argument("--link-fraction", type=float, default=0.0,
                   help="share of edges held out as valid/test link-prediction positives")
    # Not argparse's choices: a bad value is then one line naming the option.
    g.add_argument("--feature-dtype", default="float32", metavar="{float32,float16}",
                   help="the node features' type on disk: float32 (default) or float16 (half "
                        "the bytes; the collate casts the sampled rows to float32)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    g = gen.add_parser("seq", help="sequential recommendation: users' item sequences from a "
                                   "planted model (interest clusters, item successors), "
                                   "leave-last-out splits, and the Bayes-optimal HR@10 / NDCG@10")
    g.add_argument("--users", type=int, default=100_000, help="number of users (default 100,000)")
    g.add_argument("--items", type=int, default=50_000,
                   help="number of items N: ids 1..N, 0 is padding (default 50,000)")
    g.add_argument("--clusters", type=int, default=50, help="interest clusters K (default 50)")
    g.add_argument("--max-length", type=int, default=50,
                   help="history length L kept in a row (train rows: L + 1 items; default 50)")
    g.add_argument("--min-length", type=int, default=5, help="events per user, at least (>= 3)")
    g.add_argument("--mean-extra-events", type=float,
                   help="mean of the geometric number of events a user has above --min-length "
                        "(default 15; e.g. --min-length 20 --mean-extra-events 80 --max-events "
                        "700: ~100 events a user, a long tail)")
    g.add_argument("--max-events", type=int, help="events per user, at most (default 200)")
    for name, what in (("successor-prob", "the next item follows the last one's successors"),
                       ("interest-prob", "the next item is drawn from the user's interest "
                                         "cluster"),
                       ("global-prob", "the next item is drawn by global popularity"),
                       ("successor-locality", "a successor lies in its item's own cluster")):
        g.add_argument(f"--{name}", type=float,
                       help=f"probability that {what} (default: SeqDataSpec's, which "
                            f"metadata.json's generator records; the three *-prob sum to 1)")
    g.add_argument("--transition", default="item", metavar="{item,cluster}",
                   help="what a successor is: item (each item has successor items: a sparse "
                        "Markov chain over the items; default) or cluster (each cluster has "
                        "successor clusters and the next item is drawn from one's popularity: a "
                        "sparse Markov chain over the clusters, which only a model that shares "
                        "what it learns across a cluster's items can learn from few events)")
    g.add_argument("--successors", type=int,
                   help="successors S per item (transition item) or per cluster (transition "
                        "cluster; < clusters), weights S..1 (default 4)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--events", metavar="DIR",
                   help="also write the raw event log (user, item, timestamp; all users in time "
                        "order) as DIR/events/part-00000.<format>; DIR may be --out")
    # Not argparse's choices: a bad value is then one line naming the option.
    g.add_argument("--events-format", default="parquet", metavar="{parquet,csv}",
                   help="the event log's format (default parquet)")
    g = gen.add_parser("retrieval", help="retrieval: query rows (user, segment, history) "
                                         "labelled with an item, an item table (category, "
                                         "brand), a planted two-tower model and its recall@k")
    for name, default, what in (
            ("users", 100_000, "users"), ("items", 50_000, "items: ids 0..N-1"),
            ("dim", 16, "the planted vectors' dimension"), ("segments", 50, "user segments"),
            ("attributes", 3, "user attributes beside the segment (columns attr0, attr1, ...)"),
            ("attribute-values", 10, "the values of each user attribute"),
            ("categories", 100, "item categories"), ("brands", 1_000, "item brands"),
            ("min-events", 4, "events per user, at least (>= 3)"),
            ("max-events", 100, "events per user, at most"),
            ("max-length", 20, "the history kept in a row")):
        g.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default:,})")
    for name, default, what in (
            ("mean-extra-events", 40.0, "mean of the geometric count of events above --min-events"),
            ("cold-fraction", 0.05, "share of items never drawn for training (cold)"),
            ("sharpness", 25.0, "P(item | user) ∝ exp(sharpness <user, item>)"),
            ("user-noise", 0.2, "a user's own part beside its segment's and attributes'"),
            ("item-noise", 0.3, "an item's own part beside its brand's")):
        g.add_argument(f"--{name}", type=float, default=default, help=f"{what} (default {default})")
    g.add_argument("--events", action="store_true",
                   help="also write the event log the rows come from (user, segment, attr*, item, "
                        "timestamp) as OUT/events/part-00000.parquet: the input of embedtrain "
                        "ingest configs/ingest/retrieval_events.yaml")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_datagen)


def _datagen(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except ValueError as e:  # "CTRDataSpec.rows must be ..." -> the option the user gave: --rows
        def option(m: re.Match) -> str:
            name = m.group(1)
            return f"--{name.replace('_', '-')}" if hasattr(args, name) else name

        raise UsageError(re.sub(r"\b[A-Z]\w*Spec\.(\w+)", option, str(e))) from None


def _generate(args: argparse.Namespace) -> int:
    from embedtrain.datagen import CTRDataSpec, generate_ctr

    if args.kind == "xc":
        return _datagen_xc(args)
    if args.kind == "graph":
        return _datagen_graph(args)
    if args.kind == "seq":
        return _datagen_seq(args)
    if args.kind == "retrieval":
        return _datagen_retrieval(args)
    if args.drift:
        if args.structure != "criteo":
            raise UsageError("--structure: not with --drift (the drifting data set has its own "
                             "click model)")
        return _datagen_drift(args)
    knobs = [f"--drift-{f.replace('_', '-')}" for f in ("periods", "lifetime", "new_ids")
             if getattr(args, f"drift_{f}") is not None] + (["--days"] if args.days else [])
    if knobs:
        raise UsageError(f"{knobs[0]}: only with --drift")
    spec = CTRDataSpec(rows=args.rows, seed=args.seed, structure=args.structure)
    if args.format == "tsv":
        from embedtrain.datagen import generate_ctr_tsv

        with writing(args.out, complete="datagen.json") as out:
            info = generate_ctr_tsv(spec, out)
        print(f"wrote {args.out}: {info['rows']:,} rows of raw TSV in {len(info['files'])} file(s) "
              "(ingest with configs/ingest/criteo_synthetic.yaml)")
        return 0
    with writing(args.out) as out:
        meta = generate_ctr(spec, out)
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    oracle = meta["oracle_auc"].get("test")
    note = f", oracle AUC on test {oracle:.4f}" if oracle is not None else ""
    print(f"wrote {args.out}: rows: {rows}{note}")
    return 0


def _datagen_drift(args: argparse.Namespace) -> int:
    from embedtrain.datagen import DriftDataSpec, generate_ctr_drift

    if args.format == "tsv":
        raise UsageError("--format tsv: not with --drift (the drifting data set is parquet only)")
    flags = {"periods": "--drift-periods", "lifetime": "--drift-lifetime",
             "new_ids_per_period": "--drift-new-ids"}
    knobs = {"periods": args.drift_periods, "lifetime": args.drift_lifetime,
             "new_ids_per_period": args.drift_new_ids}
    if args.days is not None:
        if args.drift_periods is not None:
            raise UsageError("--days: not with --drift-periods (a day is a period)")
        knobs["periods"] = args.days
        flags["periods"] = "--days"
    try:
        spec = DriftDataSpec(rows=args.rows, seed=args.seed,
                             **{k: v for k, v in knobs.items() if v is not None})
        if args.days is not None:
            return _datagen_days(spec, args.out)
        with writing(args.out) as out:
            meta = generate_ctr_drift(spec, out)
    except ValueError as e:  # "DriftDataSpec.lifetime must be ..." -> the flag's name
        raise UsageError(re.sub(r"DriftDataSpec\.(\w+)",
                                lambda m: flags.get(m.group(1), "--" + m.group(1).replace("_", "-")),
                                str(e))) from None
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    oracle = meta["oracle_auc"].get("test")
    note = f", oracle AUC on test {oracle:.4f}" if oracle is not None else ""
    ids = " ".join(f"{s['num_embeddings']:,}" for s in meta["sparse"])
    unseen = meta["drift"]["unseen_in_train_share"]["test"]
    seen = f", {unseen:.1%} of test lookups unseen in train" if unseen is not None else ""
    print(f"wrote {args.out}: rows: {rows}{note}; {meta['drift']['periods']} periods, "
          f"distinct train ids per feature: {ids}{seen}")
    return 0


def _datagen_days(spec, out: str) -> int:
    from embedtrain.datagen.drift_days import generate_ctr_drift_days

    with writing(out, complete="partitions.json") as staging:
        index = generate_ctr_drift_days(spec, staging)
    days = index["days"]
    new = ", ".join(f"{d['new_id_share']:.0%}" for d in days[1:])
    print(f"wrote {out}: {len(days)} day partitions ({days[0]['name']} .. {days[-1]['name']}), "
          f"{sum(d['rows'] for d in days):,} rows; share of each later day's lookups of ids no "
          f"earlier day held: {new or '-'}")
    return 0


def _datagen_xc(args: argparse.Namespace) -> int:
    from embedtrain.datagen import XCDataSpec, generate_xc

    try:
        spec = XCDataSpec(classes=args.classes, rows=args.rows, vocab=args.vocab, noise=args.noise,
                          multi_label=args.multi_label, seed=args.seed)
    except ValueError as e:  # "XCDataSpec.classes must be ..." -> the flag's name
        raise UsageError(re.sub(r"XCDataSpec\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                                str(e))) from None
    with writing(args.out) as out:
        meta = generate_xc(spec, out)
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    oracle = meta.get("oracle_p_at_1", {}).get("test")
    note = f", Bayes-optimal P@1 on test {oracle:.4f}" if oracle is not None else ""
    print(f"wrote {args.out}: {spec.classes:,} classes, rows: {rows}{note}")
    return 0


def _choice(flag: str, kind, value: str):
    """``kind(value)`` (an enum), or one line naming ``flag`` and the values it takes."""
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"{flag}: expected one of {', '.join(k.value for k in kind)}, got "
                         f"{value!r}") from None


def _datagen_graph(args: argparse.Namespace) -> int:
    from embedtrain.datagen import GraphDataSpec, generate_graph
    from embedtrain.datagen.graph import NodeFeatures
    from embedtrain.graph.store import FeatureDtype

    dtype = _choice("--feature-dtype", FeatureDtype, args.feature_dtype)
    kind = _choice("--features", NodeFeatures, args.features)
    words = {k: v for k in ("vocab", "words_per_node", "topic_share")
             if (v := getattr(args, k)) is not None}
    if kind is NodeFeatures.BOW and args.feature_dim is not None:
        raise UsageError("--feature-dim: not with --features bow (its columns are --vocab)")
    if kind is not NodeFeatures.BOW and words:
        raise UsageError(f"--{next(iter(words)).replace('_', '-')}: only with --features bow")
    try:
        if args.edges is not None and args.edges < 1:
            raise UsageError(f"--edges must be a positive integer, got {args.edges}")
        if args.memory_gb is not None and not args.memory_gb > 0:
            raise UsageError(f"--memory-gb must be > 0, got {args.memory_gb}")
        degree = args.avg_degree if args.edges is None else 2 * args.edges / max(args.nodes, 1)
        spec = GraphDataSpec(nodes=args.nodes, avg_degree=degree,
                             communities=args.communities, link_fraction=args.link_fraction,
                             seed=args.seed, feature_dtype=dtype, features=kind, **words,
                             **({} if args.feature_dim is None
                                else {"feature_dim": args.feature_dim}))
        with writing(args.out) as out:
            meta = generate_graph(spec, out, memory_gb=args.memory_gb)
    except ValueError as e:  # "GraphDataSpec.avg_degree must be ..." -> the flag's name
        raise UsageError(re.sub(r"GraphDataSpec\.(\w+)",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    g = meta["generator"]
    bayes = g["feature_bayes_accuracy"]["test"] or g["feature_bayes_accuracy"]["all"]
    stored = (f", {meta['num_features']} {meta['feature_dtype']} features"
              if meta["num_features"] else "")
    print(f"wrote {args.out}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} CSR entries"
          f"{stored}, homophily {g['homophily']:.3f}, feature-only Bayes accuracy {bayes:.3f} "
          f"(one-hop Bayes {g['one_hop_bayes_accuracy']['test']:.3f})")
    return 0


def _datagen_seq(args: argparse.Namespace) -> int:
    from embedtrain.datagen import SeqDataSpec, generate_seq
    from embedtrain.datagen.seq import EVENTS_FORMATS

    if args.events_format not in EVENTS_FORMATS:
        raise UsageError(f"--events-format: expected one of {', '.join(EVENTS_FORMATS)}, got "
                         f"{args.events_format!r}")
    spec = SeqDataSpec(users=args.users, items=args.items, clusters=args.clusters,
                       max_length=args.max_length, min_length=args.min_length, seed=args.seed,
                       transition=args.transition,
                       **{k: v for k in (*SEQ_MIXTURE, "successors", "mean_extra_events",
                                         "max_events")
                          if (v := getattr(args, k)) is not None})
    where = None
    if args.events is not None:
        out, events = (Path(os.path.realpath(p)) for p in (args.out, args.events))
        if out != events and (out in events.parents or events in out.parents):
            raise UsageError(f"--events: must be --out itself or a folder outside it, got "
                             f"{args.events}")
        where = "out" if out == events else "own"
    try:
        with contextlib.ExitStack() as stack:
            out_dir = stack.enter_context(writing(args.out))
            events_dir = None
            if where == "out":
                events_dir = out_dir
            elif where == "own":
                events_dir = stack.enter_context(writing(args.events, complete="datagen.json"))
            meta = generate_seq(spec, out_dir, events_dir=events_dir,
                                events_format=args.events_format)
            if where == "own":  # what marks DIR as a complete datagen output
                info = {"format": f"seq_events_{args.events_format}", "rows": meta["events"],
                        "files": [f"events/part-00000.{args.events_format}"],
                        "columns": ["user", "item", "timestamp"], "users": meta["num_users"],
                        "num_items": meta["num_items"], "generator": meta["generator"]}
                Path(events_dir, "datagen.json").write_text(json.dumps(info, indent=2) + "\n")
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    log = (f"; event log: {Path(args.events, 'events', f'part-00000.{args.events_format}')}"
           if where else "")
    print(f"wrote {args.out}: {spec.users:,} users, {spec.items:,} items, {meta['events']:,} "
          f"events, rows: {rows}, oracle HR@10 on test {meta['oracle_hr@10']['test']:.4f}, "
          f"NDCG@10 {meta['oracle_ndcg@10']['test']:.4f}{log}")
    return 0


def _datagen_retrieval(args: argparse.Namespace) -> int:
    from embedtrain.datagen.retrieval import RetrievalDataSpec, generate_retrieval

    keys = ("users", "items", "dim", "segments", "attributes", "attribute_values", "categories",
            "brands", "min_events", "max_events", "max_length", "mean_extra_events",
            "cold_fraction", "sharpness", "user_noise", "item_noise", "seed")
    spec = RetrievalDataSpec(**{k: getattr(args, k) for k in keys})
    try:
        with writing(args.out) as out_dir:
            meta = generate_retrieval(spec, out_dir, events=args.events)
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    rows = ", ".join(f"{k} {v['rows']:,}" for k, v in meta["splits"].items())
    print(f"wrote {args.out}: {spec.users:,} users, {spec.items:,} items ({meta['cold_items']:,} "
          f"cold), {meta['events']:,} events, rows: {rows}, oracle recall@10 on test "
          f"{meta['oracle_recall@10']['test']:.4f}, recall@50 "
          f"{meta['oracle_recall@50']['test']:.4f}"
          + (f"; event log: {Path(args.out, 'events', 'part-00000.parquet')}" if args.events
             else ""))
    return 0
