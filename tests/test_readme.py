"""The commands of the README and of the documentation (``docs/**/*.md``), checked without
running them (``benchmarks/check_readme.py`` runs them).

Every ``embedtrain`` command shown in a code block of README.md or a ``docs/`` page must parse
with the CLI as it is; the shipped configs, cluster files and ingestion specs it names must exist
and load with its ``--set`` overrides; an ingestion spec's input format must match the file names
it is given; no two training commands may start a run in the same ``--out`` (the second would be
refused; a command shown on two pages is one command); and ``plan --calibrate`` must name an
``--out`` (else it rewrites the shipped cluster file).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from embedtrain.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
_COMMAND = re.compile(r"(embedtrain|python -m embedtrain|torchrun .* -m embedtrain) ")


def readme_commands(text: str) -> list[list[str]]:
    """The argv (after ``embedtrain``) of every embedtrain command in the text's code blocks:
    lines starting with ``embedtrain``, ``$ embedtrain``, ``python -m embedtrain`` or ``torchrun
    ... -m embedtrain``; continued lines joined, comments dropped."""
    commands = []
    for block in _BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if _COMMAND.match(line):
                words = shlex.split(line, comments=True)
                argv = words[words.index("embedtrain") + 1:]
                if not argv[0].endswith(":"):  # not an error message shown as output
                    commands.append(argv)
    return commands


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMANDS = list(dict.fromkeys(tuple(argv) for page in PAGES
                              for argv in readme_commands(page.read_text())))
COMMANDS = [list(argv) for argv in COMMANDS]  # each once, in page order


def _shipped(path: str) -> bool:
    return path.startswith(("configs/", "examples/"))


def test_the_readme_shows_every_command():
    shown = {argv[0] for argv in COMMANDS if argv}
    assert {"train", "eval", "plan", "ingest", "datagen", "export", "predict"} <= shown
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv)[:80])
def test_a_readme_command_parses_and_its_shipped_files_load(argv):
    if argv == ["--help"]:
        return
    args = _parser().parse_args(argv)
    sets = getattr(args, "overrides", []) or []
    if args.command == "train" and _shipped(args.config):
        from embedtrain.config import load_config

        load_config(ROOT / args.config, sets)
    for cluster in ([args.cluster] if isinstance(getattr(args, "cluster", None), str)
                    else getattr(args, "cluster", None) or []):
        if _shipped(cluster):
            from embedtrain.config import load_cluster

            load_cluster(ROOT / cluster)
    if args.command == "plan" and _shipped(args.config):
        from embedtrain.config import load_config

        load_config(ROOT / args.config, sets)
        assert not getattr(args, "calibrate", False) or args.out, \
            "plan --calibrate without --out rewrites the shipped cluster file"
    if args.command == "ingest" and _shipped(args.spec):
        from pipelines import load_spec

        spec = load_spec(ROOT / args.spec, sets)
        expected = _input_format(spec)
        for name in [*args.inputs, *(args.node_inputs or [])]:
            suffix = Path(name.rstrip("'*")).suffix.lstrip(".")
            if suffix in ("csv", "parquet", "tsv", "txt"):
                assert suffix in expected, f"{args.spec} reads {expected}, not {name}"


def _input_format(spec) -> tuple[str, ...]:
    """The file types a shipped spec reads (by its input or edge/node table formats)."""
    fmt = getattr(getattr(spec, "input", None), "format", None) or spec.edges.format
    value = fmt.value
    return {"criteo_tsv": ("tsv", "txt"), "xc_repository": ("txt",)}.get(value, (value,))


def test_no_two_readme_trainings_start_in_one_out():
    starts = [argv for argv in COMMANDS if argv[:1] == ["train"]
              and "--resume" not in argv and "--overwrite" not in argv]
    outs = [argv[argv.index("--out") + 1] for argv in starts if "--out" in argv]
    assert len(outs) == len(set(outs)), sorted(o for o in outs if outs.count(o) > 1)
