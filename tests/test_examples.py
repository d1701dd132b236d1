"""Every ``examples/<name>/run.sh`` runs as written (train -> eval -> export -> predict on data it
makes), and the examples stay short: a model of one's own in at most 40 lines of Python, the same
model trained from Python in at most 25, a task of one's own in at most 30, a query tower in at
most 20 (lines without blanks, comments and docstrings). The scripts run at once, each in its own
folder."""

import ast
import io
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "examples").glob("*/run.sh"))


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - docstrings)


def test_the_examples_are_short():
    assert code_lines(ROOT / "examples" / "custom_interaction" / "gated.py") <= 40
    assert code_lines(ROOT / "examples" / "pure_python" / "train.py") <= 25
    assert code_lines(ROOT / "examples" / "custom_task" / "huber.py") <= 30
    assert code_lines(ROOT / "examples" / "two_tower" / "towers.py") <= 20
    assert code_lines(Path(__file__)) > 25  # the counter counts


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every ``run.sh``, started at once, each in its own working folder: most of an example's
    time is its commands' start-up (importing torch and TorchRec, one core), which overlap."""
    root = tmp_path_factory.mktemp("examples")
    runs = {}
    for script in SCRIPTS:
        work = root / script.parent.name
        env = {**os.environ, "WORK": str(work),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("PYTHONPATH", None)
        log = open(root / f"{script.parent.name}.log", "w+")
        runs[script] = (subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, text=True), log, work)
    yield runs
    for proc, log, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_an_example_runs_as_written(script, started):
    proc, log, work = started[script]
    code = proc.wait(timeout=900)
    log.seek(0)
    out = log.read()
    assert code == 0, out[-3000:]
    assert (work / "predictions.parquet").is_file()
    assert f"{script.parent.name}: done" in out
