"""The overlapped load-back against the blocking one, through real
`sglang.launch_server` servers on the CPU (tp 2): two cpcache servers over
their own daemons, one per `load_back` setting, beside one
`--disable-radix-cache` reference. Every load-back's copy is slowed layer
by layer on every daemon (fault injection), standing in for a copy that
takes as long as a layer's compute.

A block sends every document once (the first ones leave the device pool),
then asks the first two again with a new question: their prefixes come
from the host pool. The time to first token of those host hits (SGLang's
own e2e latency of a one-token request) is taken per server, the servers
alternating first from block to block; figures are medians over blocks.
`cpcache bench load-back --sglang` prints them; tests/sglang/test_load_back.py
runs a short one and checks the answers (with CPCACHE_SGLANG_MORE=1).
Without `--sglang` the bench measures the mechanism alone, a stand-in
forward over a real daemon (`layer_overlap.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path
from typing import Any

from cpcache.testing.sglang_cpu.servers import Reply, make_tiny_model, same_outputs
from cpcache.testing.sglang_cpu.stacks import Reference, Shape, Stack, prompt, started, workload

SHAPE = Shape("llama", tp=2)
LAYER_DELAY_MS = 25.0  # each layer of every load-back, on every rank
DOCS = 6  # about twice the device pool: the first ones are host hits when asked again
MODES = ("overlapped", "blocking")


@contextlib.contextmanager
def servers(work: Path, model: Path, layer_delay_ms: float = LAYER_DELAY_MS,
            reference: Reference | None = None, modes: tuple[str, ...] = MODES) -> Iterator[dict[str, Stack]]:
    """The cpcache servers of `modes` (both by default; `measure` needs
    both), started: -> {mode: its stack}; the overlapped one holds the
    reference server (`reference`: one started elsewhere, of `model` at
    SHAPE's TP, instead of its own)."""
    if "overlapped" not in modes or not set(modes) <= set(MODES):
        raise ValueError(f"modes are overlapped (which holds the reference) and blocking; got {modes}")
    # Both sleep when idle (--sleep-on-idle): the one not being measured
    # would otherwise spin a core beside the one that is.
    slowed = dict(daemon_settings=dict(fault_copy_layer_delay_ms=layer_delay_ms), copy_delay_ms=0.0,
                  storage_delay_ms=0.0, per_rank={}, sleep_on_idle=True)
    own: dict[str, dict[str, Any]] = {"overlapped": dict(reference=reference),
                                      "blocking": dict(backend={"load_back": "blocking"}, with_reference=False)}
    with contextlib.ExitStack() as running:
        stacks = {}
        for mode in modes:
            (work / mode).mkdir(parents=True, exist_ok=True)
            stacks[mode] = running.enter_context(started(work / mode, model, SHAPE, **own[mode], **slowed))
        yield stacks


def host_hits(stack: Stack, reference: Stack, system: list[int], docs: list[list[int]], turn: int) -> list[Reply]:
    """One block on one server: -> the replies of the two host-hit
    requests, each checked against the reference (tokens and logprobs)."""
    for d, doc in enumerate(docs):
        stack.cpcache.generate(prompt(system, doc, turn, d), max_new_tokens=1)
    replies = []
    for d in (0, 1):
        ids = prompt(system, docs[d], turn, 100 + d)
        got = stack.cpcache.generate(ids, max_new_tokens=1)
        want = reference.reference(ids)
        first = Reply(want.output_ids[:1], want.logprobs[:1], *astuple(want)[2:])  # the reference's first token
        assert same_outputs(got, first), f"{stack.load_back}: answered {got}, a server without cache {want}"
        replies.append(got)
    return replies


def measure(stacks: dict[str, Stack], blocks: int, seed: int = 7) -> dict:
    """TTFT of host hits per load-back mode, in interleaved blocks."""
    system, docs = workload(seed=seed, docs=DOCS)
    reference = stacks["overlapped"]
    ttft: dict[str, list[float]] = {mode: [] for mode in MODES}
    hits = {mode: 0 for mode in MODES}
    for block in range(blocks):
        for mode in MODES if block % 2 == 0 else MODES[::-1]:
            measured = [r for r in host_hits(stacks[mode], reference, system, docs, 10 + block) if r.host > 0]
            hits[mode] += len(measured)
            if measured:
                ttft[mode].append(statistics.median(r.latency_s for r in measured))
    report: dict = {"blocks": blocks, "host_hit_requests": hits}
    for mode, values in ttft.items():
        if values:
            report[mode] = {"ttft_ms_median": round(1000 * statistics.median(values), 1),
                            "ttft_ms_blocks": [round(1000 * v, 1) for v in values]}
    if all(mode in report for mode in MODES):
        report["ratio_overlapped_over_blocking"] = round(
            report["overlapped"]["ttft_ms_median"] / report["blocking"]["ttft_ms_median"], 3)
    return report


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(args: argparse.Namespace) -> int:
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="cpcache-bench-load-back-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.sglang:
        model = make_tiny_model(work / "tiny-llama")
        with servers(work, model, args.layer_delay_ms) as stacks:
            report = measure(stacks, args.repeat)
        report.update(layer_delay_ms=args.layer_delay_ms, work_dir=str(work))
    else:
        from cpcache.testing import layer_overlap

        device = "cuda" if torch_cuda() else "cpu"
        report = asyncio.run(layer_overlap.measure(work, device, args.repeat, args.layer_delay_ms,
                                                   args.layer_delay_ms))
        report["host_hit_requests"] = {"overlapped": args.repeat, "blocking": args.repeat}
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    if not all(report["host_hit_requests"].values()):
        print("load-back: no host hit was measured for some mode", file=sys.stderr)
        return 1
    return 0
