"""``embedtrain doctor``: the installed versions against the verified stack (whose pins are the
requirements files' and the Makefile's), the device, cores and threads; exit 1 off the stack."""

import json
import re
from importlib import metadata

from conftest import ROOT, run_cli

from embedtrain.dependencies import VERIFIED
from embedtrain.runtime import usable_cores


def pins() -> dict[str, str]:
    """``name==version`` of requirements/cpu.txt, gpu.txt and the Makefile's torchrec line."""
    text = "\n".join((ROOT / f).read_text() for f in ("requirements/cpu.txt",
                                                       "requirements/gpu.txt", "Makefile"))
    text = re.sub(r"#.*", "", text)
    return dict(re.findall(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", text))


def test_the_verified_stack_is_the_pinned_one():
    pinned = pins()
    for names, version in VERIFIED.items():
        found = [pinned[n] for n in names.split("|") if n in pinned]
        assert found and set(found) == {version}, (names, found, version)


def test_doctor_reports_this_stack_device_and_threads():
    r = run_cli("doctor", "--nproc", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr  # the suite runs on the verified stack
    report = json.loads(r.stdout)
    torch = next(p for p in report["packages"] if p["package"] == "torch")
    assert torch["installed"] == metadata.version("torch") and torch["ok"]
    assert report["verified"] and report["device"].startswith("cpu")
    assert report["cores"] == usable_cores()
    assert report["threads_per_rank"] == max(1, usable_cores() // 2)
    text = run_cli("doctor").stdout
    assert "the verified combination" in text and f"cores: {usable_cores()}" in text


def test_off_the_stack_is_exit_1_naming_the_package(monkeypatch):
    real = metadata.version
    fake = {"torchrec": "1.7.0"}
    monkeypatch.setattr(metadata, "version", lambda name: fake.get(name) or real(name))
    r = run_cli("doctor")
    assert r.returncode == 1
    verified = re.escape(VERIFIED["torchrec"])
    assert re.search(rf"torchrec +1\.7\.0 +differs: verified with {verified}", r.stdout)
    assert "not the verified combination" in r.stdout
    r = run_cli("doctor", "--nproc", "0")
    assert r.returncode == 2 and r.stderr.strip() == (
        "embedtrain doctor: error: --nproc: must be at least 1, got 0")
