"""One release number, said alike by both commands and by a daemon's
`Status` reply (its `cpcache status` JSON carries the reply's fields)."""

import re

import pytest

import cpcache
from cpcache.daemon import settings
from cpcache.daemon.wire import DaemonStatus, status_reply
from cpcache.tools import cli


def test_the_version_is_a_semantic_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", cpcache.__version__)


def test_cpcache_version_prints_the_release(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"cpcache {cpcache.__version__}"


def test_cpcached_version_prints_the_release(capsys):
    with pytest.raises(SystemExit) as exit_:
        settings.parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"cpcached {cpcache.__version__}"


def test_the_status_reply_carries_the_version():
    status = DaemonStatus(rank=0, world_size=1, domain_ranks=(0,), mode="domain", agreement_lag=0, last_step=0,
                          rounds_completed=0, open_questions=0, state="serving", failure="", metrics_port=0,
                          attached=False, version=cpcache.__version__)
    assert status_reply(status).version == cpcache.__version__
