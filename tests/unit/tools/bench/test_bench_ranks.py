"""`cpcache bench ranks`: its arithmetic (domain sizes, the round's vector,
the bytes gloo moves for it), reading `ss` and the CLI's parsing (the short
run on 2 real ranks is tests/multirank/test_bench_ranks.py)."""

import argparse

import pytest

from cpcache.tools.bench.sizes import (
    DEFAULT_RANKS,
    GlooTraffic,
    exchange_traffic,
    expected_bytes,
    parse_ranks,
    parse_ss,
    per_round,
    ring_allreduce_traffic,
    round_vector_length,
    topology_for,
)

pytestmark = pytest.mark.timeout(60)


def test_parse_ranks_keeps_order_drops_repeats_and_refuses_what_is_not_a_domain():
    assert parse_ranks("2,4,8,16") == DEFAULT_RANKS == (2, 4, 8, 16)
    assert parse_ranks(" 8, 2,8 ,") == (8, 2)
    for bad in ("1", "2,x", "", ",", "0,4", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_ranks(bad)


@pytest.mark.parametrize("ranks, cp", [(2, 1), (3, 1), (4, 2), (8, 2), (16, 2)])
def test_each_size_is_one_domain_of_that_many_ranks(ranks, cp):
    topology = topology_for(ranks)
    assert (topology.tp, topology.cp, topology.world_size) == (ranks, cp, ranks)
    assert topology.domain(ranks - 1).ranks == tuple(range(ranks))


def test_a_one_question_round_travels_at_the_minimum_capacity():
    assert round_vector_length(1) == 7 + 64
    assert round_vector_length(64) == 7 + 64
    assert round_vector_length(65) == 7 + 128


def test_the_exchange_sends_the_whole_vector_to_every_peer():
    assert exchange_traffic(16, 71) == GlooTraffic(15 * 568, 15 * 568, 15, 15)
    # one message each way per peer, three 48-byte preambles per message
    assert exchange_traffic(2, 71).wire_sent == 568 + 144


@pytest.mark.parametrize("ranks", [2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("length", [1, 71, 1000])
def test_the_ring_moves_twice_the_buffer_less_one_share_over_all_ranks(ranks, length):
    ring = [ring_allreduce_traffic(ranks, length, r) for r in range(ranks)]
    total = 2 * (ranks - 1) * length * 8
    assert sum(t.payload_sent for t in ring) == sum(t.payload_received for t in ring) == total
    assert sum(t.messages_sent for t in ring) == sum(t.messages_received for t in ring)


def test_the_ring_cuts_large_buffers_into_segments_of_at_most_the_maximum():
    one = ring_allreduce_traffic(2, 1 << 20, 0, max_segment_bytes=1 << 20)
    # 8 MiB in 8 segments of 1 MiB, 4 per rank: each rank sends 4 in each phase
    assert one.messages_sent == one.messages_received == 8
    assert one.payload_sent == 8 << 20


def test_expected_bytes_are_what_two_and_four_ranks_measured():
    # Measured with `ss` on this machine (`cpcache bench ranks --ranks 2,4`).
    two, four = expected_bytes(2, 71, 32), expected_bytes(4, 71, 32)
    assert (two["round"]["wire_sent"], two["allreduce"]["wire_sent"]) == (712, 1144)
    assert (four["round"]["wire_sent"], four["allreduce"]["wire_sent"]) == (2136, 2580)
    assert four["round"]["payload_sent"] == 3 * 568 and four["allreduce"]["payload_sent"] == 852


def test_above_the_exchange_limit_a_round_is_a_ring_all_reduce():
    big = expected_bytes(64, 71, 32)
    assert big["round"]["algorithm"] == big["allreduce"]["algorithm"] == "gloo ring all-reduce"
    assert big["round"]["wire_sent"] == big["allreduce"]["wire_sent"]


SS = """\
ESTAB 0 0 127.0.0.1:45167 127.0.0.1:55356 users:(("python",pid=10,fd=20))
\t bbr wscale:10,10 bytes_sent:364 bytes_acked:364 bytes_received:584 segs_out:10
ESTAB 0 0 127.0.0.1:41386 127.0.0.1:43061 users:(("python",pid=11,fd=8))
\t bbr wscale:10,10 bytes_sent:11856 bytes_retrans:48 bytes_acked:11809 bytes_received:11800
ESTAB 0 0 [::ffff:127.0.0.1]:55356 [::ffff:127.0.0.1]:45167 users:(("python",pid=11,fd=3))
\t bbr wscale:10,10 bytes_sent:584 bytes_acked:585 bytes_received:364
ESTAB 0 0 127.0.0.1:43061 127.0.0.1:41386 users:(("python",pid=12,fd=8))
\t bbr wscale:10,10 bytes_acked:1 bytes_received:200
ESTAB 0 0 127.0.0.1:43062 127.0.0.1:41387 users:(("python",pid=99,fd=8))
\t bbr wscale:10,10 bytes_sent:7 bytes_received:7
"""


def test_parse_ss_sums_each_process_but_its_store_connections():
    totals = parse_ss(SS, [11, 12], exclude_port=45167)
    assert totals == {11: (11856 - 48, 11800), 12: (0, 200)}


def test_per_round_divides_by_the_collectives_and_keeps_the_extremes():
    before = {1: (100, 100), 2: (100, 100)}
    after = {1: (1100, 700), 2: (2100, 700)}
    assert per_round(before, after, 10) == {"sent": 150.0, "received": 60.0, "sent_min": 100.0, "sent_max": 200.0}
    assert per_round(None, after, 10) is None


def test_the_cli_parses_ranks_and_refuses_a_domain_of_one(monkeypatch, capsys):
    from cpcache.tools import cli
    from cpcache.tools.bench import ranks

    seen = {}

    async def fake(args):
        seen.update(vars(args))
        return 0

    monkeypatch.setattr(ranks, "main", fake)
    assert cli.main(["bench", "ranks", "--ranks", "2,8", "--repeat", "2", "--steps", "5", "--json"]) == 0
    assert (seen["ranks"], seen["repeat"], seen["steps"], seen["json"], seen["plot"]) == ((2, 8), 2, 5, True, None)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "ranks", "--ranks", "1"])
    assert exc.value.code == 2
    assert "at least 2 ranks" in capsys.readouterr().err

