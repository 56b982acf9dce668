"""What the SGLang backend refuses at start, with the flag named: checked on
SGLang's server arguments alone (no SGLang needed)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from cpcache.integrations.sglang import server_flags
from cpcache.integrations.sglang.server_flags import STORAGE_EXTRA_CONFIG, UnsupportedServer

pytestmark = pytest.mark.timeout(30)


def context(**server_args: object) -> SimpleNamespace:
    defaults = dict(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=STORAGE_EXTRA_CONFIG,
                    dp_size=1, dcp_size=1, hicache_host_memory_mode="cache")
    args = SimpleNamespace(**{**defaults, **server_args})
    return SimpleNamespace(server_args=args, disable_radix_cache=False, enable_hierarchical_cache=True,
                           is_hybrid_swa=False, is_hybrid_ssm=False)


def test_an_aggregated_or_prefill_server_is_served():
    server_flags.check(context())
    server_flags.check(context(disaggregation_mode="prefill"))


def test_a_decode_server_is_refused_with_the_reason_and_the_way_to_share_its_pages():
    with pytest.raises(UnsupportedServer, match="not a decode server") as refused:
        server_flags.check(context(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True))
    assert "decode_hicache_mixin.py" in str(refused.value)
    assert "--disaggregation-decode-enable-offload-kvcache" in str(refused.value)


def test_another_storage_backend_is_refused_naming_the_flag():
    with pytest.raises(UnsupportedServer, match="--hicache-storage-backend file"):
        server_flags.check(context(hicache_storage_backend="file"))


def test_the_storage_class_named_by_its_name_before_0_2_0_serves_with_a_warning_naming_the_new_one(caplog):
    """A server over the daemons never builds the storage class, so its
    flags are where an old launch line's class name is seen."""
    old = context(hicache_storage_backend_extra_config={**STORAGE_EXTRA_CONFIG, "class_name": "DaemonStorage"})
    with pytest.warns(DeprecationWarning, match=r"storage\.DaemonStorage is deprecated; it is now "
                      r"cpcache\.integrations\.sglang\.storage\.CpcacheStore \(give \"class_name\": \"CpcacheStore\""):
        server_flags.check(old)
    assert caplog.text.count("DaemonStorage is deprecated") == 1, caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        server_flags.check(context())  # the new name: no warning
