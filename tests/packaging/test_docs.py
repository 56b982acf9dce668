"""The documentation agrees with the code: docs/settings.md is what
scripts/docs_settings.py renders from the settings' definitions, and the
SGLang command the README and docs/sglang.md give is the one the suite runs."""

import importlib.util
from pathlib import Path

from cpcache.config import SETTINGS

REPO = Path(__file__).resolve().parents[2]


def _settings_page_generator():
    spec = importlib.util.spec_from_file_location("docs_settings", REPO / "scripts" / "docs_settings.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def test_the_settings_page_is_what_the_definitions_render():
    page = REPO / "docs" / "settings.md"
    assert page.exists(), "docs/settings.md is missing: run python scripts/docs_settings.py"
    assert page.read_text() == _settings_page_generator().render(), \
        "docs/settings.md is stale: run python scripts/docs_settings.py"


def test_every_setting_is_documented():
    page = (REPO / "docs" / "settings.md").read_text()
    missing = [name for name in SETTINGS if f"| `{name}` |" not in page]
    assert not missing, f"docs/settings.md's table lacks {missing}: run python scripts/docs_settings.py"


def test_a_new_setting_is_a_new_row_of_the_rendered_page(monkeypatch):
    """The page is rendered from the definitions, not kept by hand: a
    setting added to them appears in it (so the check above fails until the
    page is regenerated)."""
    import dataclasses

    import cpcache.config

    generator = _settings_page_generator()
    added = dataclasses.field(default=7, metadata={"help": "A setting added for this test."})
    added.name = "added_for_the_test"
    monkeypatch.setattr(cpcache.config, "SETTINGS", {**SETTINGS, added.name: added})
    rendered = generator.render()
    assert "| `added_for_the_test` | `--added-for-the-test` | `CPCACHE_ADDED_FOR_THE_TEST` | `7` |" in rendered
    assert rendered != (REPO / "docs" / "settings.md").read_text()


def _command(text: str, program: str) -> list[str]:
    """The page's command line that runs `program`, continuations joined."""
    import shlex

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if program in line)
    joined = ""
    for line in lines[start:]:
        joined += line.strip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(joined)


def test_the_documented_sglang_command_is_the_one_the_suite_runs():
    from cpcache.testing.sglang_cpu.servers import CPCACHE_FLAGS

    for page in ("README.md", "docs/sglang.md"):
        argv = _command((REPO / page).read_text(), "python -m sglang.launch_server")
        assert argv[argv.index("python"):][:3] == ["python", "-m", "sglang.launch_server"], page
        flags = argv[argv.index("sglang.launch_server") + 1:]
        pairs = {(flags[i], flags[i + 1] if i + 1 < len(flags) else "") for i in range(len(flags))}
        for i, flag in enumerate(CPCACHE_FLAGS):
            if flag.startswith("--"):
                value = CPCACHE_FLAGS[i + 1] if i + 1 < len(CPCACHE_FLAGS) and not CPCACHE_FLAGS[i + 1].startswith(
                    "--") else None
                assert flag in flags, f"{page}'s SGLang command lacks {flag}"
                if value is not None:
                    assert (flag, value) in pairs, f"{page} gives {flag} another value than the suite ({value})"


def test_one_sglang_call_table():
    """The table of what each SGLang call does lives in docs/sglang-backend.md;
    the docstrings that once repeated it point there."""
    import ast

    assert "| `release_aborted_request(rid)` |" in (REPO / "docs" / "sglang-backend.md").read_text()
    assert "release_aborted_request" not in (REPO / "docs" / "sglang.md").read_text()
    assert "release_aborted_request" not in (REPO / "README.md").read_text()
    for path in ("cpcache/integrations/sglang/radix_cache.py", "cpcache/client/session.py"):
        docstring = ast.get_docstring(ast.parse((REPO / path).read_text())) or ""
        assert "docs/sglang-backend.md" in docstring, f"{path}'s docstring does not point to docs/sglang-backend.md"
        assert "release_aborted_request" not in docstring, f"{path}'s docstring repeats the SGLang call table"


def test_every_link_between_the_pages_resolves():
    import re

    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / link).exists():
                missing.append(f"{page.relative_to(REPO)}: {link}")
    assert not missing, f"links to pages that do not exist: {missing}"
    assert "docs/settings.md" in (REPO / "README.md").read_text()


def test_the_readme_is_a_front_door():
    """What it is, the two commands, a client snippet, the SGLang launch and
    links; the reference lives in docs/."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 10_240, "the README is a front door: the reference goes to docs/"
    for said in ("make demo", "make test", "from cpcache.client import Client", "python -m sglang.launch_server"):
        assert said in readme, said
