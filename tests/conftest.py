import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def run_dir():
    """A short directory for sockets and logs (unix socket paths are limited
    to about 100 bytes, too few for pytest's tmp_path). Logs are kept when a
    test fails, for reading."""
    path = Path(tempfile.mkdtemp(prefix="cpc-"))
    yield path
    if not os.environ.get("CPCACHE_KEEP_RUN_DIR"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """A real mooncake_master on loopback for the whole session."""
    from cpcache.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as master:
        yield master
