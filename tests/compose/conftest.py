"""The compose suite: opt-in, because it builds and runs containers.

Selected by `-m compose` or CPCACHE_COMPOSE=1 (`make compose-test` runs the
script it wraps directly); skipped otherwise, so `make test` stays within its
budget and concurrent runs on one machine do not each start a stack."""

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compose: builds the image and runs compose.yaml's cpu profile (podman)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "compose" in (config.getoption("-m") or "") or os.environ.get("CPCACHE_COMPOSE") == "1":
        return
    skip = pytest.mark.skip(reason="compose suite is opt-in (podman, 1-4 min): "
                                   "`make compose-test`, or `.venv/bin/python -m pytest -m compose tests/compose`")
    for item in items:
        if "compose" in item.keywords:
            item.add_marker(skip)
