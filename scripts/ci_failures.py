"""The failed and errored tests of a pytest JUnit XML report, each with its
error lines, the project's frames and the end of its report: printed last
by `.ci/run`, so that the end of CI's output (often all that is kept of it)
names what failed and why.

    python scripts/ci_failures.py REPORT.xml [--lines N]
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("failure", "error")
# A report's telling lines: its errors ("E   ...") and the project's frames.
TELLING = re.compile(r"^(E  |(tests|cpcache|scripts|services)/\S+:\d+)")


def telling(text: str, lines: int) -> list[str]:
    """The project's frames and the error lines of a report, at most
    `lines` of them, then its last lines."""
    every = text.splitlines()
    told = [line for line in every if TELLING.match(line)][:lines]
    end = [line for line in every[-5:] if line not in told]
    return [*told, *(["..."] if end else []), *end]


def failures(report: Path) -> list[tuple[str, str, str]]:
    """-> (test id, outcome, its report's text) per failed or errored test."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for outcome in OUTCOMES:
            for element in case.findall(outcome):
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                text = "\n".join(part for part in (element.get("message", ""), element.text or "") if part)
                found.append((test, outcome, text))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--lines", type=int, default=25, help="telling lines of each report to print (default 25)")
    args = parser.parse_args(argv)
    if not args.report.exists():
        print(f"ci: no test report at {args.report}: the tests did not run to their end")
        return 0
    found = failures(args.report)
    print(f"ci: {len(found)} test(s) failed or errored")
    for test, outcome, text in found:
        print(f"--- {outcome.upper()} {test}")
        for line in telling(text, args.lines):
            print(f"    {line[:400]}")
    for test, outcome, _ in found:
        print(f"ci: {outcome.upper()} {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
