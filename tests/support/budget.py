"""What the suite leaves out to keep within CI's time, and the one switch
that runs it: CPCACHE_SGLANG_MORE=1 (docs/development.md, "Longer forms").
What is left out is covered in the suite by a neighbour (another shape,
store or deployment of the same path); the switch runs the rest too."""

from __future__ import annotations

import os

import pytest

MORE = bool(os.environ.get("CPCACHE_SGLANG_MORE"))
beyond_budget = pytest.mark.skipif(not MORE, reason="beyond the suite's budget: CPCACHE_SGLANG_MORE=1 runs it")


def more(*values: object, id: str | None = None) -> object:  # noqa: A002  (pytest.param's own name)
    """A parametrization case the suite runs only with CPCACHE_SGLANG_MORE=1."""
    return pytest.param(*values, id=id, marks=beyond_budget)
