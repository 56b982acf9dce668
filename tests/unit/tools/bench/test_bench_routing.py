"""`cpcache bench routing`'s pure parts: the arms, the server starts of a
block, the conversations' prompts, one arm's figures from its turns and the
daemons' counters, the report and its table (the run itself is SGLang's:
docs/benchmarks.md)."""

from cpcache.tools import cli
from cpcache.tools.bench import routing


def test_each_arm_names_its_servers_policy_and_gateways():
    assert routing.arm("events") == routing.Arm("events", True, "cache_aware", 1)
    assert routing.arm("approx-x2") == routing.Arm("approx-x2", False, "cache_aware", 2)
    assert routing.arm("round-robin") == routing.Arm("round-robin", False, "round_robin", 1)


def test_a_block_starts_the_servers_twice_in_an_order_swapped_every_block():
    first = routing.groups_of(0, routing.ARMS)
    second = routing.groups_of(1, routing.ARMS)
    assert [events for events, _ in first] == [True, False] and [events for events, _ in second] == [False, True]
    assert sorted(a for _, arms in first for a in arms) == sorted(routing.ARMS)
    assert dict(first)[False] != dict(second)[False]  # the arms on one start rotate too
    assert routing.groups_of(0, ("approx",)) == [(False, ["approx"])]


def test_a_turn_holds_the_document_every_earlier_turn_and_its_message():
    doc, users = routing.conversations(0, count=1, turns=3)[0]
    assert len(doc) == routing.DOC and len(users) == 3
    answers = [[7] * routing.ANSWER]
    assert routing.prompt_of(doc, users, answers) == doc + users[0] + answers[0] + users[1]
    assert routing.conversations(0) == routing.conversations(0) != routing.conversations(1)
    assert sorted(routing.round_order(0, 1, 12)) == list(range(12))


def test_an_arms_figures_take_the_tiers_from_the_daemons_and_the_rest_of_the_cached_from_the_device():
    turns = [{"conversation": 0, "turn": 0, "prompt_tokens": 352, "ttft_s": 0.2, "cached": 0},
             {"conversation": 0, "turn": 1, "prompt_tokens": 392, "ttft_s": 0.1, "cached": 352}]
    before = [{"host_hit_pages": 5, "storage_hit_pages": 0}, {"host_hit_pages": 0, "storage_hit_pages": 1}]
    after = [{"host_hit_pages": 15, "storage_hit_pages": 0}, {"host_hit_pages": 0, "storage_hit_pages": 3}]
    f = routing.figures(turns, before, after)
    # 10 pages loaded back, 2 of them prefetched from storage first
    assert (f["host"], f["storage"], f["device"]) == (128, 32, 192)
    assert f["host_storage"] == 160 and f["computed"] == 392 and f["requests"] == 2
    assert f["ttft_later_mean_ms"] == 100.0 and f["ttft_all_median_ms"] == 150.0


def test_the_report_gives_ratios_per_block_and_renders():
    def arm(host_storage: int, ttft: float) -> dict:
        return {f: 1.0 for f in routing.FIGURES} | {"host_storage": host_storage, "ttft_later_mean_ms": ttft,
                                                      "ttft_all_mean_ms": ttft}

    blocks = [{"events": arm(300, 80.0), "approx": arm(200, 100.0)},
              {"events": arm(400, 90.0), "approx": arm(200, 90.0)}]
    report = routing.summarize(blocks, ("events", "approx"), 1.0)
    assert report["ratios"]["host_storage_events_over_approx"]["blocks"] == [1.5, 2.0]
    assert report["ratios"]["ttft_later_mean_ms_events_over_approx"]["median"] == 0.9
    assert "events" in "\n".join(routing.table(report))


def test_the_command_takes_its_arms_and_the_gateways_warmup():
    args = cli.parser().parse_args(["bench", "routing", "--arms", "events,approx", "--repeat", "1", "--json"])
    assert (args.arms, args.repeat, args.gateway_warmup) == ("events,approx", 1, False)
    assert cli.parser().parse_args(["bench", "routing", "--gateway-warmup"]).gateway_warmup
