"""Worked examples of the rank layout (docs/design.md §3)."""

import pytest

from cpcache.errors import InvalidArgument
from cpcache.topology import Topology


def names_and_ranks(groups):
    return [(g.name, g.ranks) for g in groups]


def test_tp8_cp2():
    t = Topology(tp=8, cp=2)
    assert t.world_size == 8 and t.atp == 4
    assert {t.attn_tp(r).ranks for r in range(8)} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert {t.attn_cp(r).ranks for r in range(8)} == {(0, 4), (1, 5), (2, 6), (3, 7)}
    assert t.domain(5).ranks == tuple(range(8))
    assert names_and_ranks(t.grid_groups(5)) == [("attn_cp", (1, 5)), ("attn_tp", (4, 5, 6, 7))]


def test_tp8_cp8_has_attention_tp_of_one():
    t = Topology(tp=8, cp=8)
    assert t.world_size == 8 and t.atp == 1
    assert t.attn_tp(3).ranks == (3,)
    assert t.attn_cp(3).ranks == tuple(range(8))
    assert t.domain(3).ranks == tuple(range(8))
    # attn_tp has size 1 and is skipped
    assert names_and_ranks(t.grid_groups(3)) == [("attn_cp", tuple(range(8)))]


def test_tp8_dp2_cp2():
    t = Topology(tp=8, dp=2, cp=2)
    assert t.atp == 2
    # rank 6: d=1, c=1, a=0
    k = t.coordinates(6)
    assert (k.dp, k.cp, k.atp) == (1, 1, 0)
    assert t.attn_tp(6).ranks == (6, 7)
    assert t.attn_cp(6).ranks == (4, 6)
    assert t.domain(6).ranks == (4, 5, 6, 7)
    assert [d.ranks for d in t.domains()] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert names_and_ranks(t.grid_groups(6)) == [("attn_cp", (4, 6)), ("attn_tp", (6, 7))]


def test_tp2_without_cp_falls_back_to_tp():
    t = Topology(tp=2)
    assert t.attn_cp(1).ranks == (1,)
    assert names_and_ranks(t.grid_groups(1)) == [("tp", (0, 1))]
    assert t.domain(1).ranks == (0, 1)


def test_pp2_spans_stages():
    t = Topology(tp=4, pp=2, cp=2)
    assert t.world_size == 8
    k = t.coordinates(5)  # stage 1, t=1: c=0, a=1
    assert (k.pp, k.cp, k.atp) == (1, 0, 1)
    assert t.attn_tp(5).ranks == (4, 5)
    assert t.attn_cp(5).ranks == (5, 7)
    assert t.tp_group(5).ranks == (4, 5, 6, 7)
    assert t.pp_group(5).ranks == (1, 5)
    assert t.domain(5).ranks == tuple(range(8))
    assert names_and_ranks(t.grid_groups(5)) == [("attn_cp", (5, 7)), ("attn_tp", (4, 5)), ("pp", (1, 5))]


@pytest.mark.parametrize("sizes", [dict(tp=8, cp=2), dict(tp=8, dp=2, cp=2), dict(tp=4, pp=2, cp=2), dict(tp=6, cp=3)])
def test_layout_is_a_bijection_and_grid_covers_the_domain(sizes):
    t = Topology(**sizes)
    assert sorted(t.rank_of(t.coordinates(r)) for r in range(t.world_size)) == list(range(t.world_size))
    for rank in range(t.world_size):
        # sequential reductions over the grid groups reach exactly the domain
        reached = {rank}
        for group in t.grid_groups(rank):
            reached = {g for r in reached for g in _same_group_of(t, group.name, r)}
        assert reached == set(t.domain(rank).ranks)


def _same_group_of(t, name, rank):
    return {"attn_cp": t.attn_cp, "attn_tp": t.attn_tp, "tp": t.tp_group, "pp": t.pp_group}[name](rank).ranks


@pytest.mark.parametrize(
    "sizes, words",
    [
        (dict(tp=8, cp=3), ["tp=8", "dp*cp=1*3"]),
        (dict(tp=8, dp=4, cp=4), ["tp=8", "dp*cp=4*4"]),
        (dict(tp=0), ["tp", "positive"]),
        (dict(tp=4, pp=-1), ["pp", "positive"]),
    ],
)
def test_impossible_sizes_are_refused_by_name(sizes, words):
    with pytest.raises(InvalidArgument) as info:
        Topology(**sizes)
    for word in words:
        assert word in str(info.value)


def test_rank_outside_world_is_refused():
    with pytest.raises(InvalidArgument, match="rank 8 is outside the world of 8 ranks"):
        Topology(tp=8, cp=2).coordinates(8)
