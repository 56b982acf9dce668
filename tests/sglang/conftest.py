import pytest


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory):
    """The session's tiny models and reference servers (tests/sglang/stacks.py
    References): a server without cache started once per model family and
    TP, not once per stack."""
    from tests.sglang.stacks import References

    shared = References(tmp_path_factory.mktemp("references"))
    yield shared
    shared.stop()
