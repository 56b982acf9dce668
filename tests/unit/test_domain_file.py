"""A domain's settings file read for its store by a process with no daemon
(a decode server's offload): from `cpcache launch --config`'s file or from
one daemon's own `cpcached --config` file."""

from __future__ import annotations

import pytest

from cpcache.domain_file import domain_config
from cpcache.errors import InvalidArgument

pytestmark = pytest.mark.timeout(30)


def test_the_launchers_file_gives_the_store_and_the_sharding(tmp_path):
    path = tmp_path / "daemons.toml"
    path.write_text('storage = "file"\nstorage_root = "/srv/pages"\nkv_cp_sharding = "cp_replicated"\n'
                    "host_pool_pages = 64\n[rank.1]\nfault_copy_delay_ms = 400.0\n")
    config = domain_config(str(path))
    assert (config.storage, config.storage_root, config.kv_cp_sharding) == ("file", "/srv/pages", "cp_replicated")
    assert config.faults.copy_delay_ms == 0.0  # a rank's own table is not the domain's


def test_a_daemons_own_file_gives_them_too_without_its_rank(tmp_path):
    path = tmp_path / "cpcached-3.toml"
    path.write_text('rank = 3\ntp = 4\ncp = 2\nsocket = "/run/cpcache/rank-3.sock"\nstorage = "mooncake"\n'
                    'storage_master = "10.0.0.5:50051"\n')
    config = domain_config(str(path))
    assert (config.storage, config.storage_master, config.rank) == ("mooncake", "10.0.0.5:50051", 0)


def test_an_unknown_setting_or_a_missing_file_is_named(tmp_path):
    path = tmp_path / "daemons.toml"
    path.write_text('storage = "file"\nstorage_rot = "/srv"\n')
    with pytest.raises(InvalidArgument, match="unknown settings storage_rot"):
        domain_config(str(path))
    with pytest.raises(InvalidArgument, match="missing.toml"):
        domain_config(str(tmp_path / "missing.toml"))
