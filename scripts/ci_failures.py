"""The failed and errored tests of a pytest JUnit XML report, each with its
error lines, the project's frames and the end of its report, and the tests
past the suite's time limit: printed last by `.ci/run`, so that the end of
CI's output (often all that is kept of it) names what failed and why.

    python scripts/ci_failures.py REPORT.xml [--lines N]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("failure", "error")
# A report's telling lines: its errors ("E   ...") and the project's frames.
TELLING = re.compile(r"^(E  |(tests|cpcache|scripts|services)/\S+:\d+)")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def telling(text: str, lines: int) -> list[str]:
    """The project's frames and the error lines of a report, at most
    `lines` of them, then its last lines."""
    every = text.splitlines()
    told = [line for line in every if TELLING.match(line)][:lines]
    end = [line for line in every[-5:] if line not in told]
    return [*told, *(["..."] if end else []), *end]


def failures(root: ET.Element) -> list[tuple[str, str, str]]:
    """-> (test id, outcome, its report's text) per failed or errored test."""
    found = []
    for case in root.iter("testcase"):
        for outcome in OUTCOMES:
            for element in case.findall(outcome):
                text = "\n".join(part for part in (element.get("message", ""), element.text or "") if part)
                found.append((test_id(case), outcome, text))
    return found


def past_limit(root: ET.Element, limit_s: float) -> list[tuple[str, float]]:
    """-> (test id, seconds) per test whose setup, call and teardown took
    more than `limit_s` (tests/conftest.py fails the run for them)."""
    if limit_s <= 0:
        return []
    return [(test_id(case), float(case.get("time", 0))) for case in root.iter("testcase")
            if float(case.get("time", 0)) > limit_s]


def test_id(case: ET.Element) -> str:
    return f"{case.get('classname', '')}::{case.get('name', '')}"


def time_limit_s() -> float:
    options = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    return float(options.get("test_limit_s", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--lines", type=int, default=25, help="telling lines of each report to print (default 25)")
    args = parser.parse_args(argv)
    if not args.report.exists():
        print(f"ci: no test report at {args.report}: `make test` failed before pytest wrote it "
              "(setup, ruff or mypy: see above), or pytest was killed")
        return 0
    try:
        root = ET.parse(args.report).getroot()
    except ET.ParseError as exc:
        print(f"ci: the test report {args.report} cannot be read ({exc}): pytest did not finish writing it")
        return 0
    found, slow = failures(root), past_limit(root, time_limit_s())
    print(f"ci: {len(found)} test(s) failed or errored, {len(slow)} past the time limit")
    for test, outcome, text in found:
        print(f"--- {outcome.upper()} {test}")
        for line in telling(text, args.lines):
            print(f"    {line[:400]}")
    for test, outcome, _ in found:
        print(f"ci: {outcome.upper()} {test}")
    for test, seconds in slow:
        print(f"ci: PAST THE TIME LIMIT ({seconds:.0f} s) {test}")
    if not found and not slow:
        print("ci: no test failed: the run failed elsewhere (see the output above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
