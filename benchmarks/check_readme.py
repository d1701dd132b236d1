"""Runs the commands of README.md's code blocks, as written, on small data, and reports failures.

What it checks
--------------
Every command line of the README's ```bash and unlabelled ``` blocks (``embedtrain ...``,
``torchrun ...``, ``python -m embedtrain ...``, ``$ embedtrain ...``, ``make demo`` through the
Makefile's recipe), every inline code span of the prose that is a whole command (``embedtrain
plan --calibrate ...``; its ``[optional]`` parts left out, as a reader may) and every ```python
block that is a script (it starts with an import) runs in README order, in a fresh temporary
directory holding copies of the repository's ``configs/`` and ``examples/``, through ``bash -c``
(``set -o pipefail``) with the venv's ``bin`` first on PATH. ``make demo``'s data and run are made
first, as the Makefile makes them; later blocks use what earlier ones wrote, as a reader following
the README would.

- Small data: only ``datagen`` sizes change (``--rows``, ``--classes``, ``--nodes``); every
  substitution is reported. A checkpoint step a command names (``--checkpoint 500``,
  ``.../checkpoints/step_00000500``) is checked against the checkpoints the run keeps at the
  README's data size (its config's batch size, epochs, ``max_steps``, ``checkpoint_every``,
  ``keep_checkpoints``): a step never kept there fails; one that is kept is replaced by the small
  run's newest checkpoint.
- Files the README names but the repository does not ship: a spec the README shows in full (a
  ```yaml block whose paragraph names the ``*.yaml`` file) is written from the README; a config
  shown only in an error example gets the unknown key its error line names; an ingest input named
  as a plain file of a CSV/parquet or graph spec is written as a small fixture with the spec's
  columns, in the format its file name says (``.parquet``: parquet, else CSV). Skipped, with the
  reason: other inputs no earlier command writes (real data sets), ``source``, ``ray``,
  ``--address``, ``make`` targets that run no embedtrain command, ```python fragments, and
  commands that need what a skipped command writes.
- A command shown with an ``error:`` line as its output must exit with status 2 and print it.
- After every command, the copied ``configs/`` and ``examples/`` are compared with the repository's
  files as copied: a command that changes or removes a shipped file fails.

Usage
-----
    .venv/bin/python benchmarks/check_readme.py [--readme README.md] [--json FILE]
        [--timeout 600] [--keep]

Prints one row per command (result, exit status, seconds, block heading, command) with the
substitutions, the first error line of a failure and the reason for a skip; ``--json FILE``
writes the records and totals. Exit status 1 if a command failed or a shipped file changed.
Not part of ``make test``: a run takes a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
MAKEFILE = REPO / "Makefile"
SHIPPED = ("configs", "examples")
COMMAND_STARTS = ("embedtrain ", "torchrun ", "python -m embedtrain", "make ", "source ", "ray ")
SMALL_SIZES = {"ctr": {"--rows": 20_000}, "xc": {"--rows": 3_000, "--classes": 500},
               "graph": {"--nodes": 2_000}}
DATAGEN_DEFAULT_ROWS = 1_000_000  # `embedtrain datagen ctr|xc` without --rows
FIXTURE_ROWS, FIXTURE_NODES, FIXTURE_EDGES = 20_000, 2_000, 10_000
GLOB_CHARS = set("*?[")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")  # RUN_DIR, N: a usage line, not a command
CLI_ERROR = re.compile(r"^embedtrain( \w+)?: (\[rank [^\]]*\] )?error: ")
UNKNOWN_KEY = re.compile(r"error: (\S+): ([\w.]+): unknown key")


@dataclass
class Block:
    """A fenced code block of the README."""
    heading: str
    lang: str
    lines: list[str]
    paragraph: str  # the prose paragraph just before the block


@dataclass
class Command:
    """One command (or ```python script) to run, in README order."""
    heading: str
    text: str
    expected: list[str] = field(default_factory=list)  # output lines shown after a `$ ` command
    script: Optional[str] = None                        # a ```python block's source
    origin: str = ""                                    # the `make` command this line comes from
    notes: list[str] = field(default_factory=list)      # changes made to the text as written


@dataclass
class Record:
    """What happened to one command."""
    block: str
    command: str
    origin: str = ""
    ran: Optional[str] = None  # the command line as run, after substitutions
    substitutions: list[str] = field(default_factory=list)
    status: str = "skipped"    # passed | failed | skipped
    exit_code: Optional[int] = None
    seconds: float = 0.0
    error: str = ""
    reason: str = ""
    changed_files: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- README parsing

def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks, each with its section heading and the paragraph before it, and
    after each paragraph holding inline commands, a block of lang ``inline`` with them."""
    blocks: list[Block] = []
    heading, paragraph, in_paragraph = "", [], False
    current: Optional[Block] = None
    indent = 0
    for line in text.splitlines():
        fence = FENCE.match(line)
        if current is not None:
            if fence and not fence[2]:
                blocks.append(current)
                current, paragraph = None, []
            else:
                current.lines.append(line[indent:] if line.startswith(" " * indent)
                                     else line.lstrip())
            continue
        if in_paragraph and (fence or line.startswith("#") or not line.strip()):
            in_paragraph = False
            if commands := inline_commands(" ".join(paragraph)):
                blocks.append(Block(heading, "inline", commands, ""))
        if fence:
            indent = len(fence[1])
            current = Block(heading, fence[2], [], " ".join(paragraph))
        elif line.startswith("#"):
            heading, paragraph = line.lstrip("#").strip(), []
        elif line.strip():
            paragraph = paragraph if in_paragraph else []
            paragraph.append(line.strip())
            in_paragraph = True
    return blocks


def inline_commands(paragraph: str) -> list[str]:
    """Inline code spans of a paragraph that are whole commands: ``embedtrain SUBCOMMAND`` with an
    option and no placeholder (``RUN_DIR``, ``N``); output lines (``embedtrain train: ...``) are
    not."""
    commands = []
    for span in re.findall(r"`([^`]+)`", paragraph):
        words = span.split()
        if words[0] == "embedtrain" and len(words) > 2 and not words[1].endswith(":") \
                and any(w.startswith("--") for w in words) \
                and not any(PLACEHOLDER.match(w.strip("[]")) for w in words):
            commands.append(" ".join(words))
    return commands


def strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` inside quotes is kept)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def join_continuations(lines: list[str]) -> list[str]:
    """Lines ending in a backslash joined with the next one."""
    joined, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
        else:
            joined.append(pending + line.strip())
            pending = ""
    return joined


def block_commands(block: Block) -> list[Command]:
    """The commands of a block; in a block with ``$ `` prompts, other lines are their output."""
    if block.lang == "python":
        return [Command(block.heading, python_label(block.lines), script="\n".join(block.lines))]
    if block.lang == "inline":
        return [inline_command(block.heading, text) for text in block.lines]
    if block.lang not in ("", "bash", "sh", "shell", "console"):
        return []
    lines = join_continuations(block.lines)
    prompted = any(line.startswith("$ ") for line in lines)
    commands: list[Command] = []
    for line in lines:
        if prompted and not line.startswith("$ "):
            if commands and line:
                commands[-1].expected.append(line)
            continue
        text = strip_comment(line.removeprefix("$ ")).strip()
        if text.startswith(COMMAND_STARTS):
            commands.append(Command(block.heading, text))
    return commands


def inline_command(heading: str, text: str) -> Command:
    """An inline command without its ``[optional]`` parts, as a reader leaving them out runs it."""
    optional = re.findall(r"\[[^\]]*\]", text)
    return Command(f"{heading} (inline)", re.sub(r"\s*\[[^\]]*\]", "", text),
                   notes=[f"left out the optional {part}" for part in optional])


def python_label(lines: list[str]) -> str:
    first = next((line for line in lines if line.strip()), "")
    return f"python block ({len(lines)} lines): {first.strip()}"


def readme_files(blocks: list[Block]) -> dict[str, str]:
    """Files the README shows in full: a ```yaml block whose paragraph names one ``*.yaml`` file."""
    files = {}
    for block in blocks:
        names = re.findall(r"`([\w./-]+\.ya?ml)`", block.paragraph)
        if block.lang == "yaml" and len(set(names)) == 1:
            files[names[0]] = "\n".join(block.lines) + "\n"
    return files


# ---------------------------------------------------------------------------- the Makefile

@dataclass
class Rule:
    prereqs: list[str]
    recipe: list[str]


def parse_makefile(path: Path) -> tuple[dict[str, str], dict[str, Rule]]:
    """Simple variable assignments and rules (targets as written, unexpanded)."""
    variables: dict[str, str] = {}
    rules: dict[str, Rule] = {}
    current: Optional[Rule] = None
    for line in path.read_text().splitlines():
        assign = re.match(r"^(\w+)\s*(?:\?=|:=|=)\s*(.*)$", line)
        rule = re.match(r"^([^\s#:][^:=]*):(?!=)\s*(.*)$", line)
        if line.startswith("\t") and current is not None:
            current.recipe.append(line.strip())
        elif assign:
            variables[assign[1]], current = assign[2].strip(), None
        elif rule:
            current = Rule(rule[2].split(), [])
            rules.update({target: current for target in rule[1].split()})
        elif line.strip():
            current = None
    return variables, rules


def expand(text: str, variables: dict[str, str]) -> str:
    """``$(NAME)`` references replaced by the Makefile's values (others left as they are)."""
    while True:
        expanded = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), text)
        if expanded == text:
            return text
        text = expanded


def make_recipe(target: str, work: Path) -> tuple[list[str], str]:
    """The embedtrain commands ``make TARGET`` would run in ``work`` (install rules, recognised by
    ``pip install``, are left out: the venv exists; file targets that exist are up to date), or an
    empty list and the reason to skip it."""
    variables, rules = parse_makefile(MAKEFILE)
    phony = set(rules[".PHONY"].prereqs) if ".PHONY" in rules else set()
    venv = expand("$(VENV)/bin/", variables)
    lines: list[str] = []

    def visit(name: str) -> None:
        rule = rules.get(name)
        if rule is None or any("pip install" in line for line in rule.recipe):
            return
        for prereq in rule.prereqs:
            visit(prereq)
        if name in phony or not (work / expand(name, variables)).exists():
            lines.extend(expand(line, variables).removeprefix(venv) for line in rule.recipe)

    visit(target)
    other = [line for line in lines if not line.startswith("embedtrain ")]
    if other:
        return [], f"runs `{other[0]}`, not an embedtrain command (not checked here)"
    if not lines:
        return [], "only installs packages (the check uses the existing .venv)"
    return lines, ""


# ---------------------------------------------------------------------------- command lines

def cli_args(tokens: list[str]) -> list[str]:
    """The arguments after ``embedtrain`` or, for ``python``/``torchrun``, ``-m embedtrain``."""
    if tokens[0] == "embedtrain":
        return tokens[1:]
    for i in range(len(tokens) - 1):
        if tokens[i:i + 2] == ["-m", "embedtrain"]:
            return tokens[i + 2:]
    return []


def option_values(args: list[str], name: str) -> list[str]:
    """Every value of a (repeatable) option, given as ``--name VALUE`` or ``--name=VALUE``."""
    values = []
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg[len(name) + 1:])
    return values


def path_values(tokens: list[str]) -> Iterator[str]:
    """Every token, and the value of each ``key=value`` token, without a trailing slash."""
    for token in tokens:
        yield token.rstrip("/")
        if "=" in token:
            yield token.split("=", 1)[1].rstrip("/")


def under(path: str, outputs: set[str]) -> Optional[str]:
    """The output directory among ``outputs`` that ``path`` is or lies under, if any."""
    return next((out for out in outputs if path == out or path.startswith(out + "/")), None)


def shrink_datagen(text: str, args: list[str]) -> tuple[str, list[str], Optional[int]]:
    """A datagen command with small sizes: the new text, the substitutions and the README's rows."""
    sizes = SMALL_SIZES.get(args[1], {}) if args[:1] == ["datagen"] and len(args) > 1 else {}
    substitutions, readme_rows = [], None
    for option, small in sizes.items():
        given = re.search(rf"{option}(?:=|\s+)(\d+)", text)
        if given:
            text = f"{text[:given.start()]}{option} {small}{text[given.end():]}"
            substitutions.append(f"{option} {given[1]} -> {small}")
        else:
            text += f" {option} {small}"
            substitutions.append(f"{option} {small} added (not given: the default)")
        if option == "--rows":
            readme_rows = int(given[1]) if given else DATAGEN_DEFAULT_ROWS
    return text, substitutions, readme_rows


def checkpoint_ref(args: list[str]) -> Optional[tuple[str, int, str]]:
    """(run directory, step, the option's value) of a ``--checkpoint`` naming a step."""
    for value in option_values(args, "--checkpoint"):
        path = re.match(r"^(.*)/checkpoints/step_(\d+)/?$", value)
        if path:
            return path[1], int(path[2]), value
        if value.isdigit() and len(args) > 1:
            return args[1], int(value), value
    return None


def checkpoint_steps(run_dir: Path) -> list[int]:
    names = (p.name.removeprefix("step_") for p in (run_dir / "checkpoints").glob("step_*"))
    return sorted(int(name) for name in names if name.isdigit())


def kept_at_size(run_dir: Path, rows: int) -> Optional[tuple[int, list[int]]]:
    """(steps, checkpoints kept) of the run's config trained on ``rows`` rows of its data set (the
    split shares of the small one); None when the best checkpoint is also kept (not predictable)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    data, train = cfg["data"], cfg["train"]
    if train.get("select") == "best":
        return None
    splits = json.loads((Path(data["path"]) / "metadata.json").read_text())["splits"]
    train_rows = round(rows * splits["train"]["rows"] / sum(s["rows"] for s in splits.values()))
    world = json.loads((run_dir / "summary.json").read_text()).get("world_size", 1)
    share, local = math.ceil(train_rows / world), data["batch_size"] // world
    per_epoch = share // local if data.get("drop_last") else math.ceil(share / local)
    total = min(train.get("max_steps") or per_epoch * train["epochs"], per_epoch * train["epochs"])
    every = train["checkpoint_every"]
    saved = (list(range(every, total, every)) if every else []) + [total]
    return total, saved[-train["keep_checkpoints"]:]


# ---------------------------------------------------------------------------- fixtures

def write_table(columns: dict[str, list[Any]], path: Path) -> None:
    """The columns as parquet (``.parquet``) or CSV with a header line (anything else)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.table(columns), path)
        return
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(zip(*columns.values()))


def split_values(split: dict[str, Any]) -> list[str]:
    """The values a ``method: column`` split lists (the README's ``"..."`` placeholder left out)."""
    listed = [v if isinstance(v, list) else [v] for v in split.get("values", {}).values()]
    return [str(v) for values in listed for v in values if v != "..."]


def table_fixture(spec: dict[str, Any]) -> dict[str, list[Any]]:
    """Rows with the columns a tabular ingest spec reads: label, dense, sparse and split column."""
    rng, n = random.Random(0), FIXTURE_ROWS
    columns: dict[str, list[Any]] = {spec["label"]: [rng.randint(0, 1) for _ in range(n)]}
    for dense in spec.get("dense", []):
        values = [round(rng.lognormvariate(1, 1), 2) for _ in range(n)]
        columns[dense.get("column", dense["name"])] = \
            [str(v) for v in values] if dense.get("cast") else values
    for sparse in spec.get("sparse", []):
        name = sparse.get("column", sparse["name"])
        if sparse.get("multi_hot"):
            sep = sparse.get("separator", ",")
            columns.setdefault(name, [sep.join(str(rng.randrange(50))
                                               for _ in range(rng.randrange(4))) for _ in range(n)])
        else:
            columns.setdefault(name, [rng.randrange(200) for _ in range(n)])
    split = spec.get("split", {})
    if split.get("column"):
        choices = split_values(split) or [str(i) for i in range(100)]
        columns[split["column"]] = [rng.choice(choices) for _ in range(n)]
    return columns


def graph_fixture(spec: dict[str, Any]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(edges, nodes) with the columns a ``kind: graph`` spec reads."""
    rng = random.Random(0)
    ids: list[Any] = list(range(FIXTURE_NODES)) if spec.get("id_type") == "integer" \
        else [f"n{i}" for i in range(FIXTURE_NODES)]
    e, m = spec["edges"], FIXTURE_EDGES
    edges = {e["src"]: rng.choices(ids, k=m), e["dst"]: rng.choices(ids, k=m)}
    if e.get("weight"):
        edges[e["weight"]] = [round(rng.uniform(0.1, 2.0), 3) for _ in range(m)]
    if e.get("timestamp"):
        edges[e["timestamp"]] = [rng.randrange(1_000_000) for _ in range(m)]
    if e.get("edge_type"):
        edges[e["edge_type"]] = [rng.choice(e.get("edge_types") or ["link"]) for _ in range(m)]
    n = spec.get("nodes") or {}
    nodes: dict[str, list[Any]] = {n.get("id", "id"): ids}
    features = n.get("features") or []
    if isinstance(features, str):
        nodes[features] = [[rng.gauss(0, 1) for _ in range(4)] for _ in ids]
    for name in features if isinstance(features, list) else []:
        nodes[name] = [round(rng.gauss(0, 1), 3) for _ in ids]
    if n.get("label"):
        nodes[n["label"]] = [rng.choice("ABCDE") for _ in ids]
    split = spec.get("split", {})
    if split.get("method") == "column":
        per_split = [v if isinstance(v, list) else [v] for v in split["values"].values()]
        choices = [str(values[0]) for values in per_split]
        weights = [8] + [1] * (len(choices) - 1)  # most nodes in the first split (train)
        nodes[split["column"]] = rng.choices(choices, weights=weights, k=len(ids))
    return edges, nodes


def unknown_key_config(expected: list[str]) -> Optional[tuple[str, str]]:
    """(file, key path) of an ``unknown key`` error line the README shows."""
    match = next((UNKNOWN_KEY.search(line) for line in expected if UNKNOWN_KEY.search(line)), None)
    return (match[1], match[2]) if match else None


def nested(key_path: str, value: Any) -> dict[str, Any]:
    *parents, last = key_path.split(".")
    result: dict[str, Any] = {last: value}
    for parent in reversed(parents):
        result = {parent: result}
    return result


# ---------------------------------------------------------------------------- running

def command_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    return env


def run_bash(text: str, cwd: Path, env: dict[str, str],
             timeout: float) -> tuple[Optional[int], str]:
    """(exit status, stdout and stderr) of ``bash -c``; None on a timeout (its process group is
    sent SIGTERM, then SIGKILL after 10 s)."""
    proc = subprocess.Popen(["bash", "-c", f"set -o pipefail\n{text}"], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
        return None, out


def first_error(output: str) -> str:
    """The CLI's first one-line error, else a traceback's last line, else the first line that
    reads as an error, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    cli_error = next((line for line in lines if CLI_ERROR.match(line)), None)
    if cli_error:
        return cli_error
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1]
    pattern = re.compile(r"\berror\b|refused|not found|no such|cannot", re.I)
    return next((line for line in lines if pattern.search(line)), lines[-1])


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under the shipped folders (``__pycache__`` left out)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for top in SHIPPED for p in sorted((root / top).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Files of ``before`` that changed or disappeared (new files are not shipped ones)."""
    return sorted(f"{name} ({'removed' if name not in after else 'changed'})"
                  for name, digest in before.items() if after.get(name) != digest)


class Checker:
    """Runs the commands one by one in ``work``, keeping what later commands depend on."""

    def __init__(self, work: Path, files: dict[str, str], timeout: float) -> None:
        self.work, self.files, self.timeout = work, files, timeout
        self.env = command_env()
        self.records: list[Record] = []
        self.outputs: set[str] = set()          # --out of every command run
        self.skipped_outputs: set[str] = set()  # --out of every command skipped
        self.fixtures: set[str] = set()         # inputs written here (rewritten for each spec)
        self.readme_rows: dict[Path, int] = {}  # data set -> rows the README's datagen writes
        self.run_rows: dict[Path, int] = {}     # run dir -> README rows of the data it trained on
        self.scripts = 0

    def check(self, command: Command) -> None:
        print(f"[{len(self.records) + 1}] {command.text}", file=sys.stderr, flush=True)
        if command.script is not None:
            self.check_script(command)
            return
        try:
            tokens = shlex.split(command.text)
        except ValueError as e:  # unbalanced quotes
            self.records.append(Record(command.heading, command.text, status="failed",
                                       error=f"not a shell command line: {e}"))
            return
        if tokens[0] == "make":
            self.check_make(command, tokens)
            return
        record = Record(command.heading, command.text, origin=command.origin,
                        substitutions=list(command.notes))
        self.records.append(record)
        args = cli_args(tokens)
        outputs = [v.rstrip("/") for v in option_values(args, "--out")]
        record.reason = self.skip_reason(tokens, outputs) \
            or self.prepare_files(args, command.expected, record)
        if record.reason:
            self.skipped_outputs.update(outputs)
            return
        text, substitutions, readme_rows = shrink_datagen(command.text, args)
        record.substitutions += substitutions
        text = self.checkpoint_at_size(text, args, record)
        if text is None:
            return
        self.execute(text, record, command.expected)
        self.outputs.update(outputs)
        if record.status == "passed":
            self.remember(args, outputs, readme_rows)

    def check_make(self, command: Command, tokens: list[str]) -> None:
        target = next((t for t in tokens[1:] if "=" not in t), "")
        lines, reason = make_recipe(target, self.work)
        if reason:
            self.records.append(Record(command.heading, command.text, reason=reason))
        for line in lines:
            self.check(Command(command.heading, line, origin=command.text))

    def check_script(self, command: Command) -> None:
        record = Record(command.heading, command.text)
        self.records.append(record)
        code = [line for line in (command.script or "").splitlines() if line.strip()]
        if not code or not code[0].startswith(("import ", "from ")):
            record.reason = "a fragment (no imports), not a script"
            return
        self.scripts += 1
        script = self.work / ".readme_check" / f"block_{self.scripts}.py"
        script.parent.mkdir(exist_ok=True)
        script.write_text(command.script or "")
        self.execute(f"python {script.relative_to(self.work)}", record, [])

    def skip_reason(self, tokens: list[str], outputs: list[str]) -> str:
        if tokens[0] == "source":
            return "activates the venv; the check puts .venv/bin first on PATH instead"
        if tokens[0] == "ray":
            return "starts a Ray cluster node (several machines)"
        if any(t == "--address" or t.startswith("--address=") for t in tokens):
            return "joins a running Ray cluster (--address)"
        needed = next((out for value in path_values(tokens[1:]) if value not in outputs
                       and (out := under(value, self.skipped_outputs))), None)
        return f"needs {needed}, which a skipped command writes" if needed else ""

    def prepare_files(self, args: list[str], expected: list[str], record: Record) -> str:
        """Writes the files the README names but does not ship; returns a reason to skip, if any."""
        config = args[1] if len(args) > 1 and args[1].endswith((".yaml", ".yml")) else ""
        if config and not (self.work / config).exists():
            bad = unknown_key_config(expected)
            if config in self.files:
                (self.work / config).write_text(self.files[config])
                record.substitutions.append(f"wrote {config} from the README's yaml block")
            elif bad and bad[0] == config:
                (self.work / config).write_text(yaml.safe_dump(nested(bad[1], 1)))
                record.substitutions.append(
                    f"wrote {config} holding the unknown key {bad[1]} its error line names")
        return self.ingest_inputs(args, record) if args[:1] == ["ingest"] else ""

    def ingest_inputs(self, args: list[str], record: Record) -> str:
        """Writes fixtures for the ingest inputs that nothing wrote, or returns why it cannot."""
        inputs, nodes = option_values(args, "--input"), option_values(args, "--nodes")
        missing = [p for p in inputs + nodes if p in self.fixtures
                   or not glob.glob(str(self.work / p)) and not under(p, self.outputs)]
        if not missing:
            return ""
        spec_path = self.work / args[1]
        spec = yaml.safe_load(spec_path.read_text()) if spec_path.is_file() else {}
        graph = spec.get("kind") == "graph"
        table = spec.get("kind") is None \
            and spec.get("input", {}).get("format") in ("csv", "parquet")
        plain_files = not any(GLOB_CHARS & set(p) or Path(p).is_absolute() for p in missing)
        if not (plain_files and (graph or table)):
            return f"input {', '.join(missing)}: real data the repository does not ship"
        edges, node_table = graph_fixture(spec) if graph else (table_fixture(spec), {})
        for path in missing:
            columns = node_table if path in nodes else edges
            write_table(columns, self.work / path)
            self.fixtures.add(path)
            record.substitutions.append(
                f"wrote {path}: {len(next(iter(columns.values()))):,} rows of the spec's columns "
                f"{','.join(columns)} ({'parquet' if path.endswith('.parquet') else 'CSV'})")
        return ""

    def checkpoint_at_size(self, text: str, args: list[str], record: Record) -> Optional[str]:
        """The command with a named checkpoint step checked at the README's data size (None: it
        failed there) and, where the small run lacks it, replaced by the small run's newest."""
        ref = checkpoint_ref(args)
        if ref is None:
            return text
        run, step, value = ref
        run_dir = (self.work / run).resolve()
        small = checkpoint_steps(run_dir)
        rows = self.run_rows.get(run_dir)
        kept = kept_at_size(run_dir, rows) if rows else None
        if kept is None:
            return text
        total, steps = kept
        at_size = f"{rows:,} rows give {total} steps, keeping step(s) {', '.join(map(str, steps))}"
        if step not in steps:
            record.status = "failed"
            record.error = (f"checkpoint step {step} of {run} does not exist at the README's "
                            f"data size: {at_size}")
            return None
        if step in small or not small:
            return text
        new = value.replace(f"step_{step:08d}", f"step_{small[-1]:08d}") if "step_" in value \
            else str(small[-1])
        record.substitutions.append(
            f"checkpoint {value} -> {new} (kept at the README's size: {at_size})")
        return re.sub(rf"(--checkpoint(?:\s+|=)){re.escape(value)}", lambda m: m[1] + new, text)

    def execute(self, text: str, record: Record, expected: list[str]) -> None:
        before = tree_hashes(self.work)
        started = time.monotonic()
        code, output = run_bash(text, self.work, self.env, self.timeout)
        record.ran, record.exit_code = text, code
        record.seconds = round(time.monotonic() - started, 1)
        errors = [line for line in expected if ": error: " in line]
        missing = [line for line in errors if line not in output]
        if code is None:
            record.error = f"timed out after {self.timeout:.0f} s: {first_error(output)}"
        elif errors and code != 2:
            record.error = f"expected exit status 2 and {errors[0]!r}; got: {first_error(output)}"
        elif missing:
            record.error = f"expected the line {missing[0]!r}; got: {first_error(output)}"
        elif not errors and code != 0:
            record.error = first_error(output)
        record.changed_files = changed_files(before, tree_hashes(self.work))
        if record.changed_files and not record.error:
            record.error = f"changed shipped file(s): {', '.join(record.changed_files)}"
        record.status = "failed" if record.error else "passed"

    def remember(self, args: list[str], outputs: list[str], readme_rows: Optional[int]) -> None:
        """The README's data size of what a successful datagen or train wrote."""
        if args[:1] == ["datagen"] and readme_rows and outputs:
            self.readme_rows[(self.work / outputs[-1]).resolve()] = readme_rows
        if args[:1] == ["train"] and len(args) > 1:
            run = outputs[-1] if outputs else f"runs/{Path(args[1]).stem}"  # train's default
            run_dir = (self.work / run).resolve()
            config = run_dir / "config.yaml"
            data = yaml.safe_load(config.read_text())["data"]["path"] if config.is_file() else ""
            rows = self.readme_rows.get(Path(data).resolve()) if data else None
            self.run_rows.pop(run_dir, None)
            if rows:
                self.run_rows[run_dir] = rows


# ---------------------------------------------------------------------------- report

def totals(records: list[Record]) -> dict[str, Any]:
    return {
        "ran": sum(r.ran is not None for r in records),
        "passed": sum(r.status == "passed" for r in records),
        "failed": sum(r.status == "failed" for r in records),
        "skipped": sum(r.status == "skipped" for r in records),
        "changed_shipped_files": [f"{f}: {r.command}" for r in records for f in r.changed_files],
    }


def print_report(records: list[Record], summary: dict[str, Any], seconds: float) -> None:
    pad = " " * 26
    print(f"{'#':>3}  {'result':<7} {'exit':>4} {'secs':>6}  block: command")
    for i, r in enumerate(records, 1):
        exit_code = "" if r.exit_code is None else str(r.exit_code)
        origin = f"[{r.origin}] " if r.origin else ""
        print(f"{i:>3}  {r.status.upper():<7} {exit_code:>4} {r.seconds:>6.1f}  "
              f"{r.block}: {origin}{r.command}")
        for line in [f"substituted: {s}" for s in r.substitutions] + \
                [f"error: {r.error}"] * bool(r.error) + [f"skipped: {r.reason}"] * bool(r.reason):
            print(pad + line)
    print(f"\nran {summary['ran']}, passed {summary['passed']}, failed {summary['failed']}, "
          f"skipped {summary['skipped']}, shipped files changed "
          f"{len(summary['changed_shipped_files'])}; {seconds:.0f} s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--json", type=Path, help="write the records and totals here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per command")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    opts = parser.parse_args(argv)
    blocks = parse_blocks(opts.readme.read_text())
    work = Path(tempfile.mkdtemp(prefix="readme_check_"))
    started = time.monotonic()
    try:
        for top in SHIPPED:
            shutil.copytree(REPO / top, work / top, ignore=shutil.ignore_patterns("__pycache__"))
        checker = Checker(work, readme_files(blocks), opts.timeout)
        commands = [Command("(prerequisite)", "make demo")] \
            + [command for block in blocks for command in block_commands(block)]
        for command in commands:
            checker.check(command)
    finally:
        if opts.keep:
            print(f"working directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary = totals(checker.records)
    print_report(checker.records, summary, time.monotonic() - started)
    if opts.json:
        report = {"readme": str(opts.readme), "records": [asdict(r) for r in checker.records],
                  "totals": summary}
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if summary["failed"] or summary["changed_shipped_files"] else 0


if __name__ == "__main__":
    sys.exit(main())
