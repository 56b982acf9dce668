"""Which of the gateway's options reach `smg launch` (no gateway started:
its help text stands in)."""

import pytest

from cpcache.testing.sglang_cpu import gateway


@pytest.fixture
def knows(monkeypatch: pytest.MonkeyPatch):
    def set_known(*options: str) -> None:
        monkeypatch.setattr(gateway, "launch_options", lambda: frozenset(options))
    return set_known


def test_a_release_with_the_warm_up_slice_gets_it_turned_off(knows):
    knows("--policy", "--worker-warmup-secs", "--worker-warmup-divert-every")
    assert gateway.known_to_gateway(["--policy=cache_aware", *gateway.INDEX_ONLY]) == \
        ["--policy=cache_aware", *gateway.INDEX_ONLY]


def test_a_release_without_it_gets_neither_option_nor_value(knows, caplog):
    knows("--policy")
    assert gateway.known_to_gateway([*gateway.INDEX_ONLY, "--policy", "cache_aware"]) == ["--policy", "cache_aware"]
    assert "does not know --worker-warmup-secs" in caplog.text


def test_other_options_pass_as_given_and_an_unreadable_help_drops_nothing(knows):
    knows("--policy")
    assert gateway.known_to_gateway(["--anything", "a", "b"]) == ["--anything", "a", "b"]
    knows()
    assert gateway.known_to_gateway(list(gateway.INDEX_ONLY)) == gateway.INDEX_ONLY
