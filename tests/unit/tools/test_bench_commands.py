"""`cpcache bench NAME`: one subcommand per bench, with its own flags. Every
bench command the documentation, the Makefile, the GPU driver and the
suite give still parses, and a flag of another bench is refused."""

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from cpcache.tools import cli
from cpcache.tools.bench import commands

REPO = Path(__file__).resolve().parents[3]
NAMES = "|".join(sorted(commands.BENCHES, key=len, reverse=True))
# The commands the suite and the GPU driver run as programs (the suite's
# in-process ones run through cli.main in tests/unit/tools/bench).
RUN_BY_PROGRAMS = [
    "bench sglang-soak --minutes 2 --json --work-dir /tmp/w",  # tests/sglang/test_sglang_soak.py
    "bench sglang-chaos --shape cp2 --minutes 3 --json --work-dir /tmp/w",  # tests/sglang/test_sglang_chaos.py
    "bench movers --json --device-only",  # services/gpu-driver/driver.py
    "bench state --steps 5 --repeat 2 --json",  # tests/unit/tools/bench/test_bench_state.py
    "bench store-policies --trace-requests 60 --json",  # tests/unit/tools/bench/test_bench_store_policies.py
]


def documented() -> list[str]:
    """`bench NAME ...` as the pages and the Makefile write it: in inline
    code (which may wrap once) or on a line of a code block, up to a comment;
    optional parts in brackets taken, the first of `a|b` alternatives."""
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "services").rglob("*.md"))]
    spans = []
    for page in pages:
        text = page.read_text()
        spans += re.findall(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", text)
        spans += [line.split(" #")[0] for line in text.splitlines() if line.startswith("    ")]
    spans += [line.split(" #")[0] for line in (REPO / "Makefile").read_text().splitlines() if "cpcache bench" in line]
    found = []
    for span in spans:
        for match in re.finditer(rf"\bbench ({NAMES})\b[^`]*", " ".join(span.split())):
            text = re.sub(r"(\S+?)\\?\|\S+", r"\1", match.group(0).replace("[", "").replace("]", ""))
            found.append(text.strip())
    return sorted(set(found))


def test_the_documents_give_bench_commands():
    found = documented()
    assert {c.split()[1] for c in found} >= {"agreement", "ranks", "movers", "serving", "sglang-chaos"}
    assert "bench sglang-chaos --shape cp2 --json --minutes 30" in found  # brackets and alternatives read


@pytest.mark.parametrize("command", documented() + RUN_BY_PROGRAMS)
def test_every_documented_bench_command_parses(command):
    args = cli.parser().parse_args(shlex.split(command))
    assert args.command == "bench" and args.name == command.split()[1]


@pytest.mark.parametrize("name", sorted(commands.BENCHES))
def test_each_bench_takes_json_and_names_a_module_with_a_main(name):
    args = cli.parser().parse_args(["bench", name, "--json"])
    assert args.json is True
    assert importlib.util.find_spec(commands.BENCHES[name].module) is not None


@pytest.mark.parametrize("command", ["bench agreement --waves 1", "bench state --work-dir /tmp",
                                     "bench soak --repeat 3", "bench movers --minutes 2", "bench sglang --shape cp2"])
def test_a_flag_of_another_bench_is_refused(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parser().parse_args(shlex.split(command))
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_shared_flags_keep_each_benchs_defaults():
    parse = cli.parser().parse_args
    assert parse(["bench", "agreement"]).repeat == 5 and parse(["bench", "sglang-pd"]).repeat == 2
    assert parse(["bench", "ranks"]).steps == 40 and parse(["bench", "soak"]).seed == 1
    assert parse(["bench", "load-back"]).layer_delay_ms == parse(["bench", "sglang-chaos"]).layer_delay_ms == 20.0


def test_each_bench_has_its_own_help(capsys):
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["bench", "agreement", "--help"])
    out = capsys.readouterr().out
    assert "--steps" in out and "--repeat" in out and "--waves" not in out and "--minutes" not in out


def test_the_bench_runs_its_modules_main(monkeypatch):
    seen: list[argparse.Namespace] = []

    async def main(args):
        seen.append(args)
        return 0

    monkeypatch.setattr(importlib.import_module("cpcache.tools.bench.agreement"), "main", main)
    assert cli.main(["bench", "agreement", "--steps", "3"]) == 0 and seen[0].steps == 3
