"""Every script in ``benchmarks/`` starts: its imports resolve against the library as it is now
and its argument parser builds (``--help`` exits 0; a helper module with no ``__main__`` only
imports). Benchmarks are run by hand, rarely: ``bench_xc.py`` imported a name the library had
moved for a whole stop before this test. All scripts run in one child process, so torch is
imported once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, io, json, runpy, sys, traceback
failed = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
        failed[path] = "returned without --help's exit"
    except SystemExit as e:
        if e.code not in (0, None):
            failed[path] = f"exit {e.code}"
    except BaseException:
        failed[path] = traceback.format_exc(limit=-2)
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports_and_parses_its_arguments():
    scripts = sorted(str(p) for p in (ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) >= 20
    r = subprocess.run([sys.executable, "-c", CHILD, *scripts], cwd=ROOT / "benchmarks",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    failed = json.loads(r.stdout.strip().splitlines()[-1])
    for path in [p for p, why in failed.items() if why.startswith("returned")]:
        if '__name__ == "__main__"' not in Path(path).read_text():
            del failed[path]  # a helper module of the benchmarks, imported by them: it imported
    assert failed == {}, "\n".join(f"{k}: {v}" for k, v in failed.items())
