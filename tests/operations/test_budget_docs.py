"""The budget's paper trail: what docs/security.md, the unit
and the example config say agrees with `cpcache.daemon.budget`."""

import re
from pathlib import Path

from cpcache.daemon import budget

REPO = Path(__file__).resolve().parents[2]


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_the_units_file_limit_covers_the_budget():
    unit = (REPO / "services" / "cpcached" / "cpcached@.service").read_text()
    limit = int(re.search(r"^LimitNOFILE=(\d+)$", unit, re.M).group(1))
    assert limit >= budget.files(grpc_listeners=2)


def test_the_example_config_serves_metrics_on_loopback():
    example = (REPO / "services" / "cpcached" / "rank.toml.example").read_text()
    address = re.search(r'^metrics_address = "([^"]*)"', example, re.M).group(1)
    assert address.startswith("127.0.0.1:")


def test_the_security_page_states_the_budget_and_what_is_not_authenticated():
    security = (REPO / "docs" / "security.md").read_text()
    stated = section(security, "Resource budget")
    for figure in (budget.GRPC_CONNECTIONS, budget.POOLS_SERVED, budget.POOLS_TICKETS, budget.METRICS_CONNECTIONS):
        assert f"{figure:,}" in stated, figure
    said = re.search(r"LimitNOFILE=(\d+)", stated).group(0)
    assert said in (REPO / "services" / "cpcached" / "cpcached@.service").read_text()
    assert "authenticate no one" in section(security, "Mooncake")
    assert "not an identity" in section(security, "Tenants")


def test_the_security_page_states_the_timeouts_the_code_sets():
    """The idle GOAWAY, how often a flooder
    must renew handshaked connections, and the metrics deadline (one, in all)."""
    stated = section((REPO / "docs" / "security.md").read_text(), "Resource budget")
    assert f"GOAWAY after {budget.GRPC_IDLE_S:.0f} s without a call" in stated
    assert f"every {budget.GRPC_IDLE_S:.0f} s if it does" in stated
    assert f"{budget.METRICS_READ_S:.0f} s in all to send the request" in stated
    assert "SO_PASSRIGHTS" in stated  # the gRPC socket's known gap is stated
