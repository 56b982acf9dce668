"""docs/benchmarks.md's tables and benchmarks/README.md's index are what
scripts/render_benchmarks.py renders from the run files in benchmarks/runs/,
and every run file has the shape the renderer and readers expect."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks", REPO / "scripts" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pages_are_what_the_run_files_render():
    for page, text in _renderer().rendered().items():
        assert page.read_text() == text, \
            f"{page.relative_to(REPO)} is stale: run python scripts/render_benchmarks.py"


def test_every_run_file_is_well_formed_and_listed():
    runs = _renderer().load_runs()
    assert len(runs) >= 40
    index = (REPO / "benchmarks" / "README.md").read_text()
    for name, run in runs.items():
        assert f"(runs/{name}.json)" in index, name
        assert run["date"][:4] == "2026" and len(run["date"]) == 10, name
        assert run.get("commit") is None or len(run["commit"]) >= 7, name


def test_the_page_shows_current_runs_and_names_only_existing_ones():
    import re

    runs = _renderer().load_runs()
    page = (REPO / "docs" / "benchmarks.md").read_text()
    shown = set(re.findall(r"<!-- table: (\S+)", page))
    assert shown <= set(runs)
    superseded = sorted(name for name in shown if runs[name]["status"] != "current")
    assert not superseded, f"tables on the page from runs not current: {superseded}"
    cited = set(re.findall(r"`([a-z0-9-]+-\d{4}-\d\d-\d\d[a-z0-9-]*|serving-\d\d)`", page))
    assert cited <= set(runs), f"run files the page names that do not exist: {cited - set(runs)}"


def test_a_changed_figure_changes_the_rendered_table():
    renderer = _renderer()
    runs = renderer.load_runs()
    page = '<!-- table: serving-11 servers rows=0 columns=0,1 -->\n| stale |\n\nafter\n'
    rendered = renderer.render_page(page, runs)
    assert rendered == ("<!-- table: serving-11 servers rows=0 columns=0,1 -->\n| server (run 11) | TTFT mean |\n"
                        "|---|---:|\n| cpcache + Mooncake, bounded | 2186 |\n\nafter\n")
    changed = json.loads(json.dumps(runs["serving-11"]))
    changed["tables"][0]["rows"][0][1] = "1"
    assert renderer.render_page(rendered, {**runs, "serving-11": changed}) != rendered


def test_a_marker_naming_a_missing_table_is_refused():
    renderer = _renderer()
    with pytest.raises(ValueError, match="no table"):
        renderer.render_page('<!-- table: serving-11 "no such table" -->\n', renderer.load_runs())
