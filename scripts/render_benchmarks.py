"""Render the tables of docs/benchmarks.md and the index of
benchmarks/README.md from the run files in benchmarks/runs/.

A run file (JSON) holds one run, or one sitting whose runs were reported
together: the bench, the command, the commit where known, the machine, and
its figures (`tables`: columns, alignment, rows of cells as measured;
`figures`: single values). A page asks for a table with a marker line,

    <!-- table: RUN "TABLE NAME" [rows=0,2] [columns=0,1,3] -->

and the table lines right after it are the table as rendered (rows and
columns picked by index when given). benchmarks/README.md's index of runs is
rendered between `<!-- runs -->` and `<!-- end runs -->`.

    python scripts/render_benchmarks.py            # rewrite the tables in place
    python scripts/render_benchmarks.py --check    # exit 1 if a page is stale

tests/packaging/test_benchmarks.py checks that the pages are what this renders.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNS = REPO / "benchmarks" / "runs"
PAGES = [REPO / "docs" / "benchmarks.md"]
INDEX = REPO / "benchmarks" / "README.md"

REQUIRED = ("bench", "title", "status", "date", "command", "machine")
STATUSES = ("current", "superseded", "withdrawn", "not kept")
MARKER = re.compile(r"^<!-- table: (.+) -->$")


def load_runs() -> dict[str, dict]:
    """Every run file by name (without .json), checked for its shape."""
    runs = {}
    for path in sorted(RUNS.glob("*.json")):
        run = json.loads(path.read_text())
        missing = [key for key in REQUIRED if not run.get(key)]
        if missing:
            raise ValueError(f"{path.name}: lacks {missing}")
        if run["status"] not in STATUSES:
            raise ValueError(f"{path.name}: status {run['status']!r} is not one of {STATUSES}")
        if not run.get("tables") and not run.get("figures"):
            raise ValueError(f"{path.name}: neither tables nor figures")
        for table in run.get("tables", []):
            width = len(table["columns"])
            if len(table["align"]) != width or any(len(row) != width for row in table["rows"]):
                raise ValueError(f"{path.name}: table {table['name']!r} has rows or alignment of another width")
        runs[path.stem] = run
    return runs


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(table: dict, rows: list[int] | None = None, columns: list[int] | None = None) -> list[str]:
    picked_columns = columns if columns is not None else list(range(len(table["columns"])))
    picked_rows = [table["rows"][i] for i in rows] if rows is not None else table["rows"]
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(_cell(table["columns"][c]) for c in picked_columns) + " |",
             "|" + "|".join(rule[table["align"][c]] for c in picked_columns) + "|"]
    for row in picked_rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in picked_columns) + " |")
    return lines


def _table_for(spec: str, runs: dict[str, dict]) -> list[str]:
    words = shlex.split(spec)
    name, title, options = words[0], words[1], dict(word.split("=", 1) for word in words[2:])
    if name not in runs:
        raise ValueError(f"no run file benchmarks/runs/{name}.json")
    tables = {table["name"]: table for table in runs[name].get("tables", [])}
    if title not in tables:
        raise ValueError(f"{name}.json has no table {title!r} (it has {sorted(tables)})")
    pick = {key: [int(i) for i in value.split(",")] for key, value in options.items()}
    unknown = set(pick) - {"rows", "columns"}
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)} in {spec!r}")
    return render_table(tables[title], pick.get("rows"), pick.get("columns"))


def render_page(text: str, runs: dict[str, dict]) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        out.append(lines[i])
        marker = MARKER.match(lines[i])
        i += 1
        if marker:
            out.extend(_table_for(marker.group(1), runs))
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
    return "\n".join(out)


def render_index(text: str, runs: dict[str, dict]) -> str:
    lines = ["| run | bench | date | commit | status | what |", "|---|---|---|---|---|---|"]
    for name, run in sorted(runs.items(), key=lambda item: (item[1]["date"], item[0])):
        commit = run.get("commit") or ""
        lines.append(f"| [{name}](runs/{name}.json) | {_cell(run['bench'])} | {run['date']} | {commit} "
                     f"| {run['status']} | {_cell(run['title'])} |")
    start, end = text.index("<!-- runs -->\n"), text.index("<!-- end runs -->")
    return text[:start] + "<!-- runs -->\n" + "\n".join(lines) + "\n" + text[end:]


def rendered() -> dict[pathlib.Path, str]:
    """Each page as it should read."""
    runs = load_runs()
    pages = {page: render_page(page.read_text(), runs) for page in PAGES}
    pages[INDEX] = render_index(INDEX.read_text(), runs)
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from what the run files render")
    args = parser.parse_args(argv)
    stale = []
    for page, text in rendered().items():
        if page.read_text() != text:
            stale.append(page.relative_to(REPO))
            if not args.check:
                page.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}: run python scripts/render_benchmarks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
