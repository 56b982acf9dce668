import pytest

from cpcache.dataplane import gather


@pytest.fixture(params=["runs", "gather"])
def copy_path(request, monkeypatch):
    """Device <-> host copies both ways: run by run, and by gather / scatter
    (forced: the tests' jobs are a few pages, under the rule's threshold)."""
    monkeypatch.setattr(gather, "MANY_RUNS", 0 if request.param == "gather" else 1 << 30)
    return request.param
