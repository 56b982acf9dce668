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
    shutil.rmtree(path, ignore_errors=True)
