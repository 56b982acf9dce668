"""Flags win over CPCACHE_* environment variables, which win over the TOML
file; every bad value is named."""

import pytest

from cpcache.daemon.settings import as_flags, resolve
from cpcache.errors import InvalidArgument


def test_precedence_flag_over_env_over_file(tmp_path):
    config = tmp_path / "rank-0.toml"
    config.write_text('rank = 0\ntp = 4\ncp = 2\nmode = "grid"\nagreement_lag = 2\nepoch = 5\n')
    env = {"CPCACHE_AGREEMENT_LAG": "1", "CPCACHE_EPOCH": "6"}
    resolved = resolve(["--config", str(config), "--epoch", "7"], env)
    assert (resolved.tp, resolved.cp, resolved.mode) == (4, 2, "grid")  # file
    assert resolved.agreement_lag == 1  # env over file
    assert resolved.epoch == 7  # flag over env


def test_flags_round_trip():
    resolved = resolve(["--rank", "3", "--tp", "4", "--cp", "2", "--host-store", "--fault-delay-ms", "2.5"], {})
    assert resolve(as_flags(resolved), {}) == resolved
    assert resolved.faults.delay_ms == 2.5  # the fault_* settings make up the config's `faults`


@pytest.mark.parametrize(
    "argv, env, words",
    [
        ([], {}, "setting rank: is required"),
        # (a flag with a bad value is refused by argparse, which lists the choices)
        (["--rank", "0"], {"CPCACHE_MODE": "ring"}, "setting mode: must be one of domain, grid"),
        (["--rank", "0"], {"CPCACHE_TP": "four"}, "setting tp from CPCACHE_TP: 'four' is not a valid int"),
        (["--rank", "0", "--agreement-lag", "-1"], {}, "setting agreement_lag: must be >= 0"),
        (["--rank", "0", "--rendezvous", "nowhere"], {}, "setting rendezvous: must be host:port"),
        (["--rank", "4", "--tp", "4"], {}, "rank 4 is outside the world of 4 ranks"),
        (["--rank", "0", "--write-policy", "write_back"], {}, "setting write_policy: write_back needs storage"),
        (["--rank", "0", "--fault-copy-fail-rate", "2"], {}, "setting fault_copy_fail_rate: must be between 0 and 1"),
    ],
)
def test_bad_settings_are_named(argv, env, words):
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(")):
        resolve(argv, env)


def test_unknown_key_in_file_is_named(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("rank = 0\nagreement_timeout = 3\n")
    with pytest.raises(InvalidArgument, match=r"unknown settings \['agreement_timeout'\]"):
        resolve(["--config", str(config)], {})


def test_every_named_policy_has_its_class():
    from cpcache.config import PREFETCH_POLICIES, WRITE_POLICIES, CacheConfig
    from cpcache.state.policies import prefetch_policy, write_policy

    for name in WRITE_POLICIES:
        assert write_policy(CacheConfig(write_policy=name)) is not None
    for name in PREFETCH_POLICIES:
        assert prefetch_policy(CacheConfig(prefetch_policy=name)) is not None
