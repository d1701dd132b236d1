"""plan.json / plan.md / plan.html from a real, tiny plan on meta: files, content, HTML safety."""

import copy
import json
import re
from collections import Counter

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from embedtrain.sharding.planner import plan_sharding
from embedtrain.sharding.report import (
    MEMORY_PARTS,
    TIME_PARTS,
    compress_ranks,
    render_html,
    render_markdown,
    write_report,
)
from embedtrain.sharding.report_types import PlanReport
from embedtrain.sharding.types import ClusterConfig, DeviceKind, MemoryTier, PlannerOptions


def _plan(device: DeviceKind) -> PlanReport:
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000 * (i + 1),
                                 feature_names=[f"f{i}"]) for i in range(4)]
    model = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cluster = ClusterConfig(name="test-2x4", hosts=2, devices_per_host=4, device=device, hbm_gb=16)
    # small tables, spread on purpose (the tiny-table rule off): every rank has shards to draw
    return plan_sharding(model, cluster, PlannerOptions(tiny_table_bytes=0)).report


@pytest.fixture(scope="module")
def report() -> PlanReport:
    return _plan(DeviceKind.CUDA)


@pytest.fixture(scope="module")
def cpu_report() -> PlanReport:
    return _plan(DeviceKind.CPU)


def _with_warning(report: PlanReport, text: str = "rank 3 is the bottleneck") -> PlanReport:
    out = copy.deepcopy(report)
    out.warnings = [text]
    return out


def test_write_report_writes_all_formats_by_default(report, tmp_path):
    paths = write_report(report, tmp_path / "new" / "dir")
    assert [p.name for p in paths] == ["plan.json", "plan.md", "plan.html"]
    written = sorted(p.name for p in (tmp_path / "new" / "dir").iterdir())
    assert written == ["plan.html", "plan.json", "plan.md"]


def test_write_report_writes_only_requested_formats(report, tmp_path):
    assert write_report(report, tmp_path / "a", formats=["md"]) == [tmp_path / "a" / "plan.md"]
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["plan.md"]
    assert write_report(report, tmp_path / "b", formats="html") == [tmp_path / "b" / "plan.html"]


def test_plan_json_round_trips(report, tmp_path):
    (path,) = write_report(report, tmp_path, formats=("json",))
    assert json.loads(path.read_text()) == report.to_dict()
    assert json.loads(path.read_text())["summary"]["memory_tier"] == "hbm"
    loaded = PlanReport.from_dict(json.loads(path.read_text()))
    assert loaded == report
    assert render_markdown(loaded) == render_markdown(report)
    assert render_html(loaded) == render_html(report)


def test_model_section_is_written_when_set(report, tmp_path):
    described = copy.deepcopy(report)
    assert "model" not in described.to_dict()
    described.model = {"task": "ctr", "config": "configs/dlrm.yaml"}
    (path,) = write_report(described, tmp_path, formats=("json",))
    written = json.loads(path.read_text())
    assert list(written)[-1] == "model" and written["model"]["config"] == "configs/dlrm.yaml"
    assert PlanReport.from_dict(written).model == described.model


def test_unknown_format_raises_and_writes_nothing(report, tmp_path):
    with pytest.raises(ValueError, match=r"'pdf'.*json, md, html"):
        write_report(report, tmp_path / "out", formats=("md", "pdf"))
    assert not (tmp_path / "out").exists()


def test_markdown_lists_every_table_and_rank(report):
    md = render_markdown(report)
    assert md.startswith("# Sharding plan: test-2x4 (8 ranks)")
    for t in report.tables:
        assert f"| {t.name} |" in md
    for r in report.ranks:
        assert re.search(rf"^\| {r.rank} \| {r.host} \|", md, re.MULTILINE), r.rank
    assert "No warnings." in md


def test_markdown_puts_warnings_before_the_tables(report):
    md = render_markdown(_with_warning(report))
    assert "No warnings." not in md
    assert md.index("rank 3 is the bottleneck") < md.index("## Summary") < md.index("## Tables")


def test_html_is_self_contained(report):
    page = render_html(_with_warning(report))
    for banned in ("http://", "https://", "<script", "<link", "@import", "url("):
        assert banned not in page
    assert page.count("<svg") == 2
    assert "<title>Sharding plan: test-2x4 (8 ranks)</title>" in page
    assert page.index('class="warnings"') < page.index("<svg")


def test_html_draws_one_segment_per_nonzero_component(report):
    page = render_html(report)
    tier = report.summary.memory_tier
    expected = Counter()
    for r in report.ranks:
        memory = r.memory[tier]
        expected.update((str(r.rank), p) for p in MEMORY_PARTS if memory.get(p) > 0)
        expected.update((str(r.rank), p) for p in TIME_PARTS if r.time_ms.part(p) > 0)
    drawn = Counter(re.findall(r'class="seg" data-rank="(\d+)" data-part="(\w+)"', page))
    assert drawn == expected
    assert page.count('class="capacity"') == 1
    # dynamic tables' remapping state has a legend entry only where a plan has some
    remap = any(r.memory[tier].get("embedding_remap") for r in report.ranks)
    for part in list(MEMORY_PARTS) + list(TIME_PARTS):
        assert (f"</i>{part}</span>" in page) == (part != "embedding_remap" or remap)


def test_html_escapes_report_text(report):
    evil = _with_warning(report, "<img src=x onerror=alert(1)>")
    evil.tables[0].name = "<b>t&0</b>"
    page = render_html(evil)
    assert "<img" not in page and "<b>" not in page
    assert "&lt;b&gt;t&amp;0&lt;/b&gt;" in page


def test_cpu_plan_reports_ddr(cpu_report):
    assert cpu_report.summary.memory_tier is MemoryTier.DDR
    md, page = render_markdown(cpu_report), render_html(cpu_report)
    assert "total DDR GiB" in md and "Peak per-rank DDR" in md
    assert "DDR per rank (GiB)" in page and page.count('class="capacity"') == 1
    assert 'data-part="embedding_params"' in page


@pytest.mark.parametrize("ranks, text", [
    ([0, 1, 2, 3, 5, 7, 8], "0-3,5,7-8"),
    (range(128), "0-127"),
    ([23, 16, 17, 18, 19, 20, 21, 22, 0, 1, 2, 3, 4, 5, 6, 7], "0-7,16-23"),
    ([4, 4], "4"),
    ([], ""),
])
def test_compress_ranks(ranks, text):
    assert compress_ranks(ranks) == text
