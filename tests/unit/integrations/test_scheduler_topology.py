"""The topology the SGLang backend declares at attach, from the scheduler's
server arguments (outside SGLang's processes, where no runtime width is
published): attention CP and DP split the TP ranks; the deprecated
`--dp N --enable-dp-attention` spelling counts as `--attn-dp-size N`, since
a scheduler's own arguments may carry a width of 1 there."""

from types import SimpleNamespace

import pytest

from cpcache.integrations.sglang.backend import scheduler_topology

pytestmark = pytest.mark.timeout(30)


def args(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(**{"attn_cp_size": 1, "pp_size": 1, "dp_size": 1, "enable_dp_attention": False,
                              **fields})


@pytest.mark.parametrize("fields,tp,want", [
    (dict(attn_cp_size=2), 2, (2, 2, 1)),
    (dict(attn_dp_size=2), 2, (2, 1, 2)),
    (dict(attn_dp_size=1, dp_size=2, enable_dp_attention=True), 2, (2, 1, 2)),
    (dict(dp_size=2, enable_dp_attention=True), 4, (4, 1, 2)),
    (dict(attn_dp_size=2, attn_cp_size=2), 8, (8, 2, 2)),
])
def test_attention_cp_and_dp_split_the_tp_ranks(fields: dict, tp: int, want: tuple[int, int, int]):
    topology = scheduler_topology(args(**fields), tp)
    assert (topology.tp, topology.cp, topology.dp) == want


def test_the_runtime_width_wins_over_the_schedulers_own_arguments(monkeypatch: pytest.MonkeyPatch):
    from cpcache.integrations.sglang import backend

    monkeypatch.setattr(backend, "_runtime_attention_dp", lambda: 2)
    assert scheduler_topology(args(attn_dp_size=1), 2).dp == 2  # what a DP scheduler's own arguments say


def test_without_attention_dp_the_dp_size_is_not_an_attention_width():
    assert scheduler_topology(args(dp_size=2), 2).dp == 1
