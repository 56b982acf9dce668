"""`cpcache bench sglang-pd`: TTFT and prompt throughput of a PD pair (a
prefill `sglang.launch_server` at `--tp 2 --attn-cp-size 2`, a decode one at
tp 1, SGLang's router in front: cpcache/testing/sglang_cpu/pd.py) for three
prefill servers, all else equal:

- `radix`: SGLang's plain radix cache;
- `cpcache`: over cpcache daemons (host pool of HOST_PAGES pages, file
  storage), its decode server offloading the pages it generates into the
  same store (`pd.over_cpcache`: the product's PD shape);
- `hicache`: SGLang's own HiCache with as many host pages and its `file`
  storage, its decode server offloading into that storage with SGLang's own
  decode offload (without it, should that fail: the report says so).

The model is a random Qwen3 (MODEL) large enough that a prefill's compute,
not the serving around it, is most of a miss's TTFT on this CPU. The
workload is multi-turn conversations, run concurrently (a thread each): a
shared system prompt, then per turn a user message and the model's answer
(greedy, ignore_eos), turn k's prompt holding every earlier turn and its
streamed answer. The prefill's device pool (DEVICE_TOKENS) is smaller than
the conversations, so its host and storage tiers are hit. The decode
server's pool is larger (DECODE_TOKENS, and it reserves ANSWER tokens per
request instead of SGLang's 512): with the prefill's pool and the default
reserve, a decode server never admits a 600-token prompt. It is the same in
every configuration.

An idle SGLang server's loops spin, so one pair runs at a time: a block
starts each configuration (in an order rotated every block), runs the
block's conversations (seeded by the block) and stops it. Per configuration
and block: time to healthy, TTFT over turn 0 and over the later turns
(mean, median, p90), prompt throughput (prompt tokens over the wall time of
the conversations), cached tokens per tier (the prefill's, from the last
streamed chunk's meta_info), and every output compared with radix's for
the same conversation and turn. Ratios (cpcache/radix, cpcache/hicache)
are per block; the report gives their median over the blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
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
    from cpcache.testing.sglang_cpu.pd import PdDeployment

CONFIGS = ("radix", "cpcache", "hicache")
TP, CP = 2, 2  # the prefill server's; the decode server runs at tp 1
PAGE = 16
DEVICE_TOKENS = 1024  # the prefill's device pool: 64 pages
HOST_PAGES = 2 * DEVICE_TOKENS // PAGE  # cpcache's host pool; HiCache's holds as many
DECODE_TOKENS = 4096
SYSTEM, USER, ANSWER = 256, 64, 32  # tokens of the system prompt, of each user message, of each answer
VOCAB = 500  # token ids below it: the model's vocabulary is 512
MODEL = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.5)
DECODE_FLAGS = ["--max-total-tokens", str(DECODE_TOKENS), "--num-reserved-decode-tokens", str(ANSWER)]
TIERS = ("cached", "device", "host", "storage")


# -- pure parts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversations:
    count: int
    turns: int

    def messages(self, block: int) -> tuple[list[int], list[list[list[int]]]]:
        """Block `block`'s system prompt, and each conversation's user messages, one per turn."""
        rng = random.Random(block)
        system = [rng.randrange(1, VOCAB) for _ in range(SYSTEM)]
        return system, [[[rng.randrange(1, VOCAB) for _ in range(USER)] for _ in range(self.turns)]
                        for _ in range(self.count)]


def turn_prompt(system: list[int], users: list[list[int]], answers: list[list[int]]) -> list[int]:
    """The prompt of turn len(answers): the system prompt, every earlier
    (user message, answer), then this turn's user message."""
    ids = list(system)
    for user, answer in zip(users, answers):
        ids += user + answer
    return ids + users[len(answers)]


def ttft_figures(seconds: list[float]) -> dict[str, float]:
    """Mean, median and p90 (inclusive method) of TTFTs, in ms."""
    if not seconds:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p90_ms": float("nan")}
    p90 = statistics.quantiles(seconds, n=10, method="inclusive")[8] if len(seconds) > 1 else seconds[0]
    return {"mean_ms": round(statistics.mean(seconds) * 1e3, 1),
            "median_ms": round(statistics.median(seconds) * 1e3, 1), "p90_ms": round(p90 * 1e3, 1)}


def figures(turns: list[dict], seconds: float) -> dict:
    """One configuration's figures in a block, from its turns and the wall time they took."""
    prompt_tokens = sum(t["prompt_tokens"] for t in turns)
    out = {"seconds": round(seconds, 2), "prompt_tokens": prompt_tokens,
           "prompt_tok_s": round(prompt_tokens / seconds, 1) if seconds > 0 else float("nan")}
    for part, chosen in (("first", [t for t in turns if t["turn"] == 0]), ("later", [t for t in turns if t["turn"]])):
        out.update({f"ttft_{part}_{k}": v for k, v in ttft_figures([t["ttft_s"] for t in chosen]).items()})
    out.update({tier: sum(t[tier] for t in turns) for tier in TIERS})
    return out


def mismatches(outputs: dict[str, dict[tuple[int, int], list[int]]], baseline: str = "radix") -> list[dict]:
    """Every (configuration, conversation, turn) whose output ids differ from `baseline`'s."""
    want = outputs.get(baseline, {})
    return [{"config": name, "conversation": c, "turn": k}
            for name, got in outputs.items() if name != baseline
            for (c, k), ids in sorted(got.items()) if (c, k) in want and ids != want[(c, k)]]


def order_of(block: int) -> tuple[str, ...]:
    """The configurations' order in block `block`: rotated every block."""
    k = block % len(CONFIGS)
    return CONFIGS[k:] + CONFIGS[:k]


# -- the servers -----------------------------------------------------------------------------------------------


def make_model(path: Path) -> Path:
    """MODEL: a random Qwen3, saved by transformers in SGLang's environment."""
    from cpcache.testing.sglang_cpu.servers import sglang_interpreter

    script = ("import json, sys, torch\nfrom transformers import Qwen3Config, Qwen3ForCausalLM\n"
              "torch.manual_seed(0)\nQwen3ForCausalLM(Qwen3Config(**json.loads(sys.argv[2]))).save_pretrained(sys.argv[1])\n")
    subprocess.run([sglang_interpreter(), "-c", script, str(path), json.dumps(MODEL)], check=True,
                   capture_output=True, timeout=600)
    return path


def deployment(name: str, work: Path, model: Path, decode_offload: bool = True) -> PdDeployment:
    from cpcache.testing.sglang_cpu.hicache import HICACHE_ENV, hicache_file_storage_flags, hicache_host_flags
    from cpcache.testing.sglang_cpu.pd import PdDeployment, over_cpcache

    decode_flags = list(DECODE_FLAGS)
    if name == "radix":
        return PdDeployment(work, model, prefill_tp=TP, prefill_cp=CP, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                            decode_flags=decode_flags)
    if name == "cpcache":
        return over_cpcache(work, model, tp=TP, cp=CP, host_pages=HOST_PAGES,
                            storage=dict(storage="file", storage_root=str(work / "pages")), page_size=PAGE,
                            device_tokens=DEVICE_TOKENS, decode_flags=decode_flags)
    root = work / "hicache-pages"
    flags = hicache_host_flags(HOST_PAGES, PAGE, DEVICE_TOKENS)  # as many host pages as cpcache's
    if decode_offload:  # SGLang's own offload of the decode server's pages, into the prefill's storage
        decode_flags += ["--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend",
                         "file", "--hicache-storage-backend-extra-config",
                         json.dumps({"file_storage_path": str(root)}), "--hicache-io-backend", "direct",
                         "--hicache-mem-layout", "layer_first"]
    return PdDeployment(work, model, prefill_tp=TP, prefill_cp=CP, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                        prefill_flags=[*flags, *hicache_file_storage_flags(root)], decode_flags=decode_flags,
                        prefill_env=dict(HICACHE_ENV), decode_env=dict(HICACHE_ENV))


def converse(port: int, conversation: int, system: list[int], users: list[list[int]]) -> list[dict]:
    """Every turn of one conversation, each prompt holding the answers streamed before it."""
    answers: list[list[int]] = []
    turns = []
    for k in range(len(users)):
        ids = turn_prompt(system, users, answers)
        stream = stream_generate(port, ids, ANSWER, timeout_s=300.0)
        meta = stream.meta
        details = meta.get("cached_tokens_details") or {}
        turns.append({"conversation": conversation, "turn": k, "prompt_tokens": len(ids), "ttft_s": stream.ttft(),
                      "output_ids": stream.output_ids, "cached": int(meta.get("cached_tokens") or 0),
                      **{tier: int(details.get(tier) or 0) for tier in TIERS[1:]}})
        answers.append(stream.output_ids)
    return turns


def run_conversations(port: int, system: list[int], users: list[list[list[int]]]) -> tuple[list[dict], float]:
    """Every conversation at once, a thread each: -> their turns and the wall time."""
    results: list[list[dict] | BaseException] = [[] for _ in users]

    def one(c: int) -> None:
        try:
            results[c] = converse(port, c, system, users[c])
        except BaseException as exc:  # noqa: BLE001  (re-raised below, on the caller's thread)
            results[c] = exc

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in range(len(users))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [t for r in results if isinstance(r, list) for t in r], seconds


def measure(name: str, work: Path, model: Path, system: list[int], users: list[list[list[int]]],
            decode_offload: bool = True) -> tuple[dict, dict[tuple[int, int], list[int]]]:
    """Start configuration `name`, run the conversations, stop it: -> its figures and outputs."""
    work.mkdir(parents=True, exist_ok=True)
    pd = deployment(name, work, model, decode_offload)
    try:
        pd.start().wait_ready(timeout_s=900)
        turns, seconds = run_conversations(pd.router_port, system, users)
    finally:
        pd.stop()
    out = figures(turns, seconds)
    out["ready_s"] = round(pd.ready_s["all"], 1)
    return out, {(t["conversation"], t["turn"]): t["output_ids"] for t in turns}


# -- the report ------------------------------------------------------------------------------------------------

FIGURES = ("ready_s", "prompt_tok_s", "ttft_first_mean_ms", "ttft_first_median_ms", "ttft_first_p90_ms",
           "ttft_later_mean_ms", "ttft_later_median_ms", "ttft_later_p90_ms", *TIERS)


def summarize(blocks: list[dict[str, dict]], conversations: Conversations, wrong: list[dict], notes: list[str],
              wall_s: float) -> dict:
    configs = [name for name in CONFIGS if all(name in b for b in blocks)]
    ratios = {f"{figure}_{num}_over_{den}": block_ratios(blocks, key, num, den)
              for figure, key in (("ttft_later", "ttft_later_median_ms"), ("prompt_throughput", "prompt_tok_s"))
              for num, den in (("cpcache", "radix"), ("cpcache", "hicache"), ("hicache", "radix"))
              if num in configs and den in configs}
    return {
        "bench": "sglang-pd",
        "setup": {"prefill": f"tp {TP}, attention CP {CP}, device pool {DEVICE_TOKENS} tokens",
                  "decode": f"tp 1, device pool {DECODE_TOKENS} tokens, {ANSWER} reserved per request",
                  "model": f"random Qwen3 {MODEL}, float32, SGLang's CPU path", "page_size": PAGE,
                  "host_pages": HOST_PAGES, "mode": "one PD pair at a time: started, measured, stopped; the "
                  "configurations' order rotates every block"},
        "workload": {"conversations": conversations.count, "turns": conversations.turns, "system_tokens": SYSTEM,
                     "user_tokens": USER, "answer_tokens": ANSWER, "blocks": len(blocks)},
        "configs": {name: {f: block_summary([b[name][f] for b in blocks], digits=1) for f in FIGURES}
                    for name in configs},
        "ratios": ratios, "output_mismatches": wrong, "notes": notes, "blocks": blocks, "wall_s": round(wall_s, 1),
    }


def table(report: dict) -> list[str]:
    w = report["workload"]
    out = [f"cpcache bench sglang-pd: {w['blocks']} blocks of {w['conversations']} conversations x {w['turns']} turns "
           "(medians over blocks)",
           f"{'config':<8} {'healthy s':>9} {'TTFT turn 0 ms mean/med/p90':>28} {'TTFT turns>=1 ms mean/med/p90':>30} "
           f"{'prompt tok/s':>12}  cached tokens (device/host/storage)"]
    for name, f in report["configs"].items():
        def m(key: str, f: dict = f) -> float:
            return f[key]["median"]

        out.append(f"{name:<8} {m('ready_s'):>9.0f} "
                   f"{m('ttft_first_mean_ms'):>10.0f}/{m('ttft_first_median_ms'):.0f}/{m('ttft_first_p90_ms'):<8.0f} "
                   f"{m('ttft_later_mean_ms'):>12.0f}/{m('ttft_later_median_ms'):.0f}/{m('ttft_later_p90_ms'):<8.0f} "
                   f"{m('prompt_tok_s'):>12.1f}  {m('cached'):.0f} ({m('device'):.0f}/{m('host'):.0f}/"
                   f"{m('storage'):.0f})")
    out.append("ratio per block (TTFT: median over turns >= 1), median over blocks (min-max)")
    for name, r in report["ratios"].items():
        out.append(f"  {name:<44} {r['median']:.3f} ({r['spread']['min']:.3f}-{r['spread']['max']:.3f})")
    out.append(f"outputs unlike radix's: {len(report['output_mismatches'])}; wall {report['wall_s']:.0f} s")
    out += [f"note: {n}" for n in report["notes"]]
    return out


def run(conversations: Conversations, repeat: int, keep: Path | None = None,
        configs: tuple[str, ...] = CONFIGS) -> dict:
    work = keep or Path(tempfile.mkdtemp(prefix="cpcache-bench-sglang-pd-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model = make_model(work / "qwen3-512")
    blocks: list[dict[str, dict]] = []
    wrong: list[dict] = []
    notes: list[str] = []
    decode_offload = True  # hicache's decode server: SGLang's own offload, until it fails
    ok = False
    try:
        for i in range(repeat):
            system, users = conversations.messages(i)
            block: dict[str, dict] = {}
            outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
            for name in (n for n in order_of(i) if n in configs):
                place = work / f"block{i}-{name}"
                try:
                    block[name], outputs[name] = measure(name, place, model, system, users, decode_offload)
                except Exception as exc:
                    if name != "hicache" or not decode_offload:
                        raise
                    decode_offload = False
                    notes.append(f"hicache with SGLang's decode offload failed ({type(exc).__name__}: {exc}; logs "
                                 f"in {place}); hicache's decode server runs without offload from block {i} on")
                    block[name], outputs[name] = measure(name, work / f"block{i}-{name}-no-offload", model,
                                                         system, users, decode_offload)
                print(f"block {i} {name}: {block[name]}", file=sys.stderr, flush=True)
            wrong += [{"block": i, **m} for m in mismatches(outputs)]
            blocks.append(block)
        ok = True
    finally:
        if ok and keep is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            print(f"cpcache bench sglang-pd: logs kept in {work}", file=sys.stderr)
    if decode_offload and "hicache" in configs:
        notes.append("hicache's decode server offloaded into its file storage (SGLang's decode offload)")
    return summarize(blocks, conversations, wrong, notes, time.monotonic() - started)


def main(args: argparse.Namespace) -> int:
    from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON

    if not SGLANG_PYTHON.exists():
        print(f"cpcache bench sglang-pd: SGLang's environment is not built ({SGLANG_PYTHON} is missing): `make setup` "
              "builds .venv-sglang (or set CPCACHE_SGLANG_PYTHON).", file=sys.stderr)
        return 1
    report = run(Conversations(args.conversations, args.turns), args.repeat,
                 Path(args.work_dir) if args.work_dir else None)
    print(json.dumps(report) if args.json else "\n".join(table(report)))
    return 0
