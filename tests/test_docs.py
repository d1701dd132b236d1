"""The documentation site: it builds with ``mkdocs build --strict``, its reference pages are
generated from the code (a config key or spec field without a comment fails the generator), and
the code blocks of ``docs/**/*.md`` and README.md are valid: Python parses, YAML loads, and every
``embedtrain`` command of a shell block parses with the CLI."""

import ast
import dataclasses
import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embedtrain.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```",
                   re.S | re.M)
SHELL = ("bash", "sh", "shell", "console")
COMMAND = re.compile(r"^(embedtrain|python -m embedtrain|torchrun .* -m embedtrain) ")


@functools.cache
def _reference_hook():
    """``docs/hooks/reference.py``, the generator of the reference pages, as a module."""
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  ROOT / "docs" / "hooks" / "reference.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(lang: str) -> list[tuple[str, str]]:
    """``(page:line, body)`` of every fenced block of ``lang`` (its indent removed)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m["lang"] == lang:
                indent = len(m["indent"])
                body = "\n".join(line[indent:] for line in m["body"].splitlines())
                found.append((f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}",
                              body))
    return found


def _commands() -> list[tuple[str, str]]:
    """``(page:line, command)`` of every embedtrain command of a shell block (continuations
    joined; in a ``console`` block only the ``$ `` lines, the others being output)."""
    found = []
    for lang in SHELL:
        for where, body in _blocks(lang):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if lang == "console":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                if COMMAND.match(line):
                    found.append((where, line))
    return found


@pytest.mark.slow
def test_the_site_builds_strict_with_the_generated_reference(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    config = (site / "reference" / "config" / "index.html").read_text()
    for key in ("data.batch_size", "train.max_steps", "head.dtype", "sharding.tiny_table_bytes",
                "tables[].capacity", "cluster.hbm_gb", "embedtrain.train.loggers:TensorBoard"):
        assert key in config, key
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "--nproc" in cli and "embedtrain datagen seq" in cli
    spec = (site / "reference" / "ingest-spec" / "index.html").read_text()
    for key in ("split.method", "tokens.min_frequency", "nodes.feature_dtype", "split.valid_time"):
        assert key in spec, key
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="embedtrain.fit"' in api and 'id="embedtrain.export_run"' in api
    assert not re.search(r":(class|func|meth|attr|mod|exc):`", api)  # roles shown as code


def test_sphinx_roles_become_code_spans():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from roles import plain
    finally:
        sys.path.pop(0)
    assert plain("See :class:`Trainer` and :func:`~embedtrain.api.fit`, :meth:`a.b <x>`.") == (
        "See `Trainer` and `fit`, `a.b`.")
    assert plain("``literal`` stays") == "``literal`` stays"


def test_a_key_without_a_comment_fails_the_generator():
    reference = _reference_hook()

    @dataclasses.dataclass
    class Spec:
        """A small spec."""

        # rows a file holds
        rows: int = 10
        name: str = "x"  # the data set's name
        silent_key: float = 0.5

    with pytest.raises(reference.UndocumentedError, match=r"Spec\.silent_key \(silent_key\)"):
        reference.schema_keys((Spec, ""))
    with pytest.raises(reference.UndocumentedError, match=r"Spec\.silent_key \(a\.silent_key\)"):
        reference.schema_keys((Spec, "a."))


def test_comments_are_read_above_inline_and_continued():
    reference = _reference_hook()

    @dataclasses.dataclass
    class Spec:
        """A small spec."""

        # the first key,
        # in two lines
        first: int = 1
        second: int = 2       # its inline comment
        #                       continued under it
        third: int = 3        # one line
        # the fourth key's own
        fourth: int = 4

    (keys,) = reference.schema_keys((Spec, "s."))
    docs = {k.path: k.doc for k in keys}
    assert docs == {"s.first": "the first key, in two lines",
                    "s.second": "its inline comment continued under it",
                    "s.third": "one line", "s.fourth": "the fourth key's own"}


def test_every_config_and_spec_key_is_documented():
    reference = _reference_hook()
    assert "`data.batch_size`" in reference.config_reference()
    assert "`split.method`" in reference.ingest_spec_reference()


@pytest.mark.parametrize("where,body", _blocks("python"), ids=lambda v: str(v)[:40])
def test_python_blocks_parse(where, body):
    ast.parse(body, filename=where)


@pytest.mark.parametrize("where,body", _blocks("yaml"), ids=lambda v: str(v)[:40])
def test_yaml_blocks_load(where, body):
    yaml.safe_load(body)


# No command in the pages uses a shell variable; one that did would need its value here.
@pytest.mark.parametrize("where,line", _commands(), ids=lambda v: str(v)[:60])
def test_shell_commands_parse_with_the_cli(where, line):
    words = shlex.split(line, comments=True)
    argv = words[words.index("embedtrain") + 1:]
    assert not any("$" in w for w in argv), f"{where}: a shell variable: {line}"
    try:
        _parser().parse_args(argv)
    except SystemExit as e:
        if argv != ["--help"] or e.code != 0:
            pytest.fail(f"{where}: {line}: exit status {e.code}")


def test_the_pages_have_code_blocks():
    assert len(_blocks("python")) >= 4 and len(_blocks("yaml")) >= 6
    assert len(_commands()) > 60
