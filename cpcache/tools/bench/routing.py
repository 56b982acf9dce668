"""`cpcache bench routing`: which server a gateway picks, and what it costs.

Two SGLang servers (`sglang.launch_server --smg-grpc-mode`, tp 1, a random
Qwen3), each over its own cpcache domain, one shared file store beneath
both, behind Shepherd Model Gateway (`smg launch`; the fleet:
cpcache/testing/sglang_cpu/gateway.py). The arms:

- `events`: `cache_aware` on the servers' KV events (`--kv-events-config`):
  the device tree's and cpcache's host pool (`CPU_PINNED`) and storage
  (`DISK`), relayed by the servicer's `SubscribeKvEvents`;
- `approx`: `cache_aware` on the gateway's approximate tree (the servers
  publish nothing);
- `round-robin`;
- `events-x2`, `approx-x2`: the same with two gateway replicas, requests
  alternating between them (each approximate tree knows only its own half).

The gateway's warm-up slice (cache misses and one hit in eight diverted to
a worker it finds new or thin) is off unless `--gateway-warmup`: every
decision is then its routing index's.

The workload is multi-turn conversations (CONVERSATIONS, each its own
DOC-token document, then per turn a USER-token message and the ANSWER
tokens streamed back; greedy). A round sends one turn of every
conversation, in a shuffled order, two at a time. Their working set is
several times one server's device pool and fits the two host pools, so a
later turn finds its prefix on the device, in the host pool of the server
that served it before, or in the shared store.

The servers start twice per block, once publishing events (for `events`
and `events-x2`) and once not (for the others), in an order swapped every
block; between two arms on the same servers the gateway flushes both
(cpcache's tiers then chain from a new seed: nothing of the last arm is
hit) and a fresh gateway starts. Per arm and block: TTFT (mean, median) of
every turn and of the later turns, cached tokens per tier (the device's
from the replies, the host's and storage's from the daemons' own hit
counters: pages loaded back, less those a prefetch brought from storage,
and pages prefetched from storage), and the tokens computed. Ratios are per block; the report gives
their median over the blocks.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cpcache.testing.stats import block_summary
from cpcache.tools.bench.sglang import block_ratios, stream_generate

if TYPE_CHECKING:
    from cpcache.testing.sglang_cpu.gateway import Fleet

ARMS = ("events", "events-x2", "approx", "approx-x2", "round-robin")
CONVERSATIONS, TURNS = 12, 4
DOC, USER, ANSWER = 320, 32, 8  # tokens
VOCAB = 500
CONCURRENCY = 2
PAGE = 16
DEVICE_TOKENS = 1024  # 64 pages per server: about two conversations
HOST_PAGES = 256  # per server: about eight conversations


@dataclass(frozen=True)
class Arm:
    name: str
    events: bool  # the servers publish KV events
    policy: str
    gateways: int


def arm(name: str) -> Arm:
    gateways = 2 if name.endswith("-x2") else 1
    if name == "round-robin":
        return Arm(name, False, "round_robin", 1)
    return Arm(name, name.startswith("events"), "cache_aware", gateways)


# -- the workload (pure) ----------------------------------------------------------------------------------------


Conversation = tuple[list[int], list[list[int]]]  # a document, and a user message per turn


def conversations(block: int, count: int = CONVERSATIONS, turns: int = TURNS) -> list[Conversation]:
    """Block `block`'s conversations: each a document and its user messages."""
    rng = random.Random(block)
    return [([rng.randrange(1, VOCAB) for _ in range(DOC)],
             [[rng.randrange(1, VOCAB) for _ in range(USER)] for _ in range(turns)]) for _ in range(count)]


def prompt_of(doc: list[int], users: list[list[int]], answers: list[list[int]]) -> list[int]:
    ids = list(doc)
    for user, answer in zip(users, answers):
        ids += user + answer
    return ids + users[len(answers)]


def round_order(block: int, turn: int, count: int) -> list[int]:
    order = list(range(count))
    random.Random(f"{block}:{turn}").shuffle(order)
    return order


def ttft_figures(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"mean_ms": float("nan"), "median_ms": float("nan")}
    return {"mean_ms": round(statistics.mean(seconds) * 1e3, 1),
            "median_ms": round(statistics.median(seconds) * 1e3, 1)}


def figures(turns: list[dict], before: list[dict[str, int]], after: list[dict[str, int]]) -> dict:
    """One arm's figures in a block: its turns, and the daemons' counters around them."""
    def delta(key: str) -> int:
        return sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before))

    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached"] for t in turns)
    # A daemon counts the pages it loaded back to the device (from its host
    # pool, some of them just prefetched there from storage) and the pages
    # it prefetched from storage.
    loaded, storage = delta("host_hit_pages") * PAGE, delta("storage_hit_pages") * PAGE
    host = max(loaded - storage, 0)
    out = {"requests": len(turns), "prompt_tokens": prompt, "cached": cached, "host": host, "storage": storage,
           "device": max(cached - loaded, 0), "computed": prompt - cached, "host_storage": host + storage}
    out |= {f"ttft_all_{k}": v for k, v in ttft_figures([t["ttft_s"] for t in turns]).items()}
    out |= {f"ttft_later_{k}": v for k, v in ttft_figures([t["ttft_s"] for t in turns if t["turn"]]).items()}
    return out


# -- one arm ----------------------------------------------------------------------------------------------------


def run_arm(ports: list[int], model: str, convs: list[Conversation], block: int) -> list[dict]:
    """Every round of the conversations through the gateways at `ports`
    (conversation c's turn k through gateway (c + k) % len(ports)),
    CONCURRENCY at a time: -> one record per turn."""
    answers: list[list[list[int]]] = [[] for _ in convs]
    records: list[dict] = []
    lock = threading.Lock()
    for turn in range(len(convs[0][1])):
        work: queue.SimpleQueue[int] = queue.SimpleQueue()
        for c in round_order(block, turn, len(convs)):
            work.put(c)
        failures: list[BaseException] = []

        def worker(turn: int = turn, work: queue.SimpleQueue[int] = work, failures: list = failures) -> None:
            while True:
                try:
                    c = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    doc, users = convs[c]
                    ids = prompt_of(doc, users, answers[c])
                    stream = stream_generate(ports[(c + turn) % len(ports)], ids, ANSWER, timeout_s=300.0,
                                             model=model)
                    with lock:
                        answers[c].append(stream.output_ids)
                        records.append({"conversation": c, "turn": turn, "prompt_tokens": len(ids),
                                        "ttft_s": stream.ttft(), "cached": int(stream.meta.get("cached_tokens") or 0)})
                except BaseException as exc:  # noqa: BLE001  (re-raised below, on the caller's thread)
                    failures.append(exc)
                    return

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(CONCURRENCY)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
    return records


def measure(spec: Arm, fleet: Fleet, work: Path, convs: list[Conversation], block: int,
            gateway_flags: list[str]) -> dict:
    from cpcache.testing.sglang_cpu.gateway import Gateway

    gateways = [Gateway(work, fleet.model, fleet.urls(), spec.policy, name=f"block{block}-{spec.name}-gw{g}",
                        events=spec.events, flags=gateway_flags) for g in range(spec.gateways)]
    try:
        for g in gateways:
            g.start()
        before = fleet.counters()
        turns = run_arm([g.port for g in gateways], str(fleet.model), convs, block)
        after = fleet.counters()
        gateways[0].flush_cache()  # the next arm on these servers starts cold
    finally:
        for g in gateways:
            g.stop()
    return figures(turns, before, after)


# -- the run ----------------------------------------------------------------------------------------------------

FIGURES = ("ttft_all_mean_ms", "ttft_all_median_ms", "ttft_later_mean_ms", "ttft_later_median_ms", "prompt_tokens",
           "cached", "device", "host", "storage", "host_storage", "computed")


def make_model(work: Path) -> Path:
    from cpcache.testing.sglang_cpu.servers import make_tiny_model
    from cpcache.tools.bench.serving import add_tokenizer

    return add_tokenizer(make_tiny_model(work / "qwen3", "qwen3"))


def groups_of(block: int, arms: tuple[str, ...]) -> list[tuple[bool, list[str]]]:
    """Block `block`'s server starts: (events on, the arms on them), in an
    order swapped every block, the arms within rotated."""
    out = []
    for events in ((True, False) if block % 2 == 0 else (False, True)):
        names = [a for a in arms if arm(a).events == events]
        k = block % len(names) if names else 0
        if names:
            out.append((events, names[k:] + names[:k]))
    return out


def run(repeat: int, keep: Path | None = None, arms: tuple[str, ...] = ARMS, warmup: bool = False) -> dict:
    """`warmup`: the gateway's warm-up slice on (its default), else INDEX_ONLY."""
    from cpcache.testing.sglang_cpu.gateway import INDEX_ONLY, Fleet

    gateway_flags = [] if warmup else list(INDEX_ONLY)
    work = keep or Path(tempfile.mkdtemp(prefix="cpcache-bench-routing-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model = make_model(work)
    blocks: list[dict[str, dict]] = []
    for i in range(repeat):
        convs = conversations(i)
        block: dict[str, dict] = {}
        for events, names in groups_of(i, arms):
            place = work / f"block{i}-{'events' if events else 'silent'}"
            place.mkdir(parents=True, exist_ok=True)
            fleet = Fleet(place, model, events=events, device_tokens=DEVICE_TOKENS, host_pages=HOST_PAGES,
                          page_size=PAGE)
            try:
                fleet.start()
                for name in names:
                    block[name] = measure(arm(name), fleet, place, convs, i, gateway_flags)
                    print(f"block {i} {name}: {block[name]}", file=sys.stderr, flush=True)
            finally:
                fleet.stop()
        blocks.append(block)
    return summarize(blocks, arms, time.monotonic() - started, warmup)


def summarize(blocks: list[dict[str, dict]], arms: tuple[str, ...], wall_s: float, warmup: bool = False) -> dict:
    names = [a for a in arms if all(a in b for b in blocks)]
    pairs = [(n, d) for n, d in (("events", "approx"), ("events", "round-robin"), ("events-x2", "approx-x2"),
                                 ("approx", "round-robin")) if n in names and d in names]
    ratios = {f"{figure}_{num}_over_{den}": block_ratios(blocks, figure, num, den)
              for figure in ("host_storage", "host", "ttft_later_mean_ms", "ttft_all_mean_ms") for num, den in pairs}
    return {
        "bench": "routing",
        "setup": {"servers": "2 x sglang.launch_server --smg-grpc-mode, tp 1, each over its own cpcache domain, "
                  "one shared file store", "gateway": "smg launch (Shepherd Model Gateway), its warm-up slice "
                  + ("on (its default)" if warmup else "off (--worker-warmup-secs 0 --worker-warmup-divert-every 0)"),
                  "model": "random Qwen3 (2 layers, hidden 64, vocab 512), float32, SGLang's CPU path",
                  "page_size": PAGE, "device_tokens": DEVICE_TOKENS, "host_pages": HOST_PAGES,
                  "mode": "per block: the servers started with events, then without (order swapped every block); "
                  "between arms on the same servers a flush and a fresh gateway"},
        "workload": {"conversations": CONVERSATIONS, "turns": TURNS, "doc_tokens": DOC, "user_tokens": USER,
                     "answer_tokens": ANSWER, "concurrency": CONCURRENCY, "blocks": len(blocks)},
        "arms": {name: {f: block_summary([b[name][f] for b in blocks], digits=1) for f in FIGURES} for name in names},
        "ratios": ratios, "blocks": blocks, "wall_s": round(wall_s, 1),
    }


def table(report: dict) -> list[str]:
    w = report["workload"]
    out = [f"cpcache bench routing: {w['blocks']} blocks of {w['conversations']} conversations x {w['turns']} turns "
           "(medians over blocks)",
           f"{'arm':<12} {'TTFT ms mean/median':>20} {'later turns':>14} {'cached tokens':>14}  device/host/storage "
           f"{'computed':>9}"]
    for name, f in report["arms"].items():
        def m(key: str, f: dict = f) -> float:
            return f[key]["median"]

        out.append(f"{name:<12} {m('ttft_all_mean_ms'):>11.0f}/{m('ttft_all_median_ms'):<8.0f} "
                   f"{m('ttft_later_mean_ms'):>7.0f}/{m('ttft_later_median_ms'):<6.0f} {m('cached'):>14.0f}  "
                   f"{m('device'):.0f}/{m('host'):.0f}/{m('storage'):.0f} {m('computed'):>9.0f}")
    out.append("ratio per block, median over blocks (min-max)")
    for name, r in report["ratios"].items():
        out.append(f"  {name:<48} {r['median']:.3f} ({r['spread'].get('min', float('nan')):.3f}-"
                   f"{r['spread'].get('max', float('nan')):.3f})")
    out.append(f"wall {report['wall_s']:.0f} s")
    return out


def main(args: argparse.Namespace) -> int:
    from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON

    if not SGLANG_PYTHON.exists():
        print(f"cpcache bench routing: SGLang's environment is not built ({SGLANG_PYTHON} is missing): `make setup` "
              "builds .venv-sglang with smg (or set CPCACHE_SGLANG_PYTHON).", file=sys.stderr)
        return 1
    arms = tuple(a for a in (args.arms or ",".join(ARMS)).split(","))
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"cpcache bench routing: unknown arms {unknown}; choose among {', '.join(ARMS)}", file=sys.stderr)
        return 2
    report = run(args.repeat, Path(args.work_dir) if args.work_dir else None, arms, args.gateway_warmup)
    print(json.dumps(report) if args.json else "\n".join(table(report)))
    return 0
