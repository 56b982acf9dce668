"""What the ranks of a domain agree on at Attach: the model dtype is part of
it when a client declares one, and absent otherwise (so an older client's
attach is described as it was before the field)."""

from cpcache.config import DaemonConfig
from cpcache.geometry import KVGeometry
from cpcache.rank.attach import attach_descriptor

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=16, dtype="bfloat16", page_size=16)


def test_the_model_dtype_is_agreed_when_declared():
    config = DaemonConfig(rank=0)
    older = attach_descriptor(config, "m", GEOMETRY, 8)
    assert "model_dtype" not in older and older == attach_descriptor(config, "m", GEOMETRY, 8, "")
    f32, bf16 = (attach_descriptor(config, "m", GEOMETRY, 8, dtype) for dtype in ("float32", "bfloat16"))
    assert f32["model_dtype"] == "float32" and len({repr(d) for d in (older, f32, bf16)}) == 3


def test_daemons_of_other_state_rules_are_told_apart_at_attach():
    """An older daemon describes no `state_rules`: its attach never agrees
    with this one's, rather than diverging rounds later."""
    from cpcache.state.machine import STATE_RULES

    described = attach_descriptor(DaemonConfig(rank=0), "m", GEOMETRY, 8)
    assert described["state_rules"] == STATE_RULES >= 2
