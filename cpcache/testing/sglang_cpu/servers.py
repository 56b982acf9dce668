"""Real SGLang servers on a host without CUDA, started the way docs/sglang.md says:
`python -m sglang.launch_server` (its tokenizer manager, spawned schedulers
and detokenizer, HTTP on a TCP port), with tiny random models made by
transformers at test time (TINY_MODELS: Llama, Qwen3, Qwen3-MoE, DeepSeek-V2
with MLA), at TP and attention CP (prefill CP too: ZIGZAG_FLAGS with
ZIGZAG_ENV, cpu_host/cp_torch_native.py), and `cpcache launch` daemons beneath.

SGLang's own HiCache runs here too, for side-by-side comparisons: its
flags are in hicache.py.

Every wait is on an event: a process's own readiness line on its output
(SGLang prints one when it serves, `cpcache launch` when its ranks serve),
or its exit.

Used by the SGLang suite (tests/sglang) and `cpcache bench sglang`; both need
SGLang's environment (`sglang_python`): the interpreter named by
CPCACHE_SGLANG_PYTHON, or the `.venv-sglang` that `make setup` builds beside
the running environment, or the running interpreter itself when it has SGLang.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cpcache.errors import Unavailable
from cpcache.integrations.sglang.server_flags import STORAGE_EXTRA_CONFIG
from cpcache.testing.ports import free_port


def sglang_python() -> Path:
    """The interpreter of SGLang's environment: CPCACHE_SGLANG_PYTHON when
    set; else `.venv-sglang` beside the environment running this one (where
    `make setup` puts it); else this interpreter when it can import SGLang
    (cpcache installed into SGLang's environment). When none is found, the
    `.venv-sglang` path, which does not exist (`sglang_interpreter` says so;
    the suites skip on it)."""
    named = os.environ.get("CPCACHE_SGLANG_PYTHON")
    if named:
        return Path(named)
    beside = Path(sys.prefix).parent / ".venv-sglang" / "bin" / "python"
    if beside.exists() or importlib.util.find_spec("sglang") is None:
        return beside
    return Path(sys.executable)


SGLANG_PYTHON = sglang_python()


def sglang_interpreter() -> str:
    """SGLANG_PYTHON, or an error that says how to provide it."""
    if not SGLANG_PYTHON.exists():
        raise Unavailable(f"SGLang's environment is not found ({SGLANG_PYTHON} is missing): set "
                          "CPCACHE_SGLANG_PYTHON to an interpreter with SGLang 0.5.23 and cpcache installed, or run "
                          "`make setup` in a checkout of cpcache (it builds .venv-sglang beside .venv)")
    return str(SGLANG_PYTHON)
CPCACHE = Path(sys.executable).parent / "cpcache"
# On PYTHONPATH of every SGLang process here: stand-ins for two GPU-only packages.
CPU_HOST = Path(__file__).resolve().parent / "cpu_host"

# What every SGLang server here runs with: SGLang's CPU path for a tiny model.
CPU_FLAGS = ["--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "torch_native",
             "--disable-cuda-graph", "--dtype", "float32"]
# What the cpcache backend needs (docs/sglang.md, "The flags"): the backend; the
# per-iteration hook (with a fixed host ratio, so SGLang does not size a host
# pool it never builds); storage prefetch through the daemon
# (CPCACHE_HOST_FLAGS: the host tier only), named as the backend checks it.
CPCACHE_HOST_FLAGS = ["--radix-cache-backend", "cpcache", "--enable-hierarchical-cache", "--hicache-ratio", "1"]
CPCACHE_FLAGS = [*CPCACHE_HOST_FLAGS, "--hicache-storage-backend", "dynamic",
                 "--hicache-storage-backend-extra-config", json.dumps(STORAGE_EXTRA_CONFIG)]
PLAIN_FLAGS = ["--disable-radix-cache"]
# Prefill context parallelism (the zigzag split of a prefill's tokens over the
# CP ranks), which torch_native runs only with cpu_host/cp_torch_native.py.
ZIGZAG_FLAGS = ["--enable-prefill-cp", "--cp-strategy", "zigzag"]
ZIGZAG_ENV = {"CPCACHE_TEST_CP_TORCH_NATIVE": "1"}
# Attention DP (`--enable-dp-attention`) pads each rank's batch, which
# torch_native needs cpu_host/dp_attention_cpu.py for.
DP_ATTENTION_ENV = {"CPCACHE_TEST_DP_ATTENTION_CPU": "1"}
READY = "The server is fired up and ready to roll"
# A server stopped (SIGTERM to its process group) sees its schedulers die and
# takes it for a crash: SGLang then sleeps 5 s before looking for py-spy and
# CUDA core dumps, at every stop. There is nothing to diagnose here.
NO_CRASH_DIAGNOSTICS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# A port taken before the server bound it: its HTTP port (uvicorn), its gRPC
# port (in gRPC mode), or the port its ranks meet on (torch's TCPStore),
# which SGLang picks by itself.
BIND_FAILED = ("error while attempting to bind on address", "EADDRINUSE", "Failed to bind to address")


def bind_failed(output: str) -> bool:
    return any(marker in output for marker in BIND_FAILED)


# Tiny random models per family (no tokenizer: requests send ids). Llama
# serves at attention TP > 1 only: under attention CP its KV pool is sized
# for attention TP 1 while its layers compute K for TP 2 (4 KV heads crash,
# 1 KV head gives outputs other than tp 1's). Qwen3 and Qwen3-MoE serve under
# attention CP with outputs equal to tp 1's.
# The Qwen families have grouped KV heads (8 query heads, 2 KV heads) and
# weights large enough (initializer_range 0.5) that a wrong attention moves
# the logprobs well past the suite's tolerance: with the default 0.02 the
# model is nearly uniform and a mask off by one token changes them by 1e-5.
_QWEN = "num_attention_heads=8, num_key_value_heads=2, head_dim=16, initializer_range=0.5"
# DeepSeek-V2: multi-head latent attention (a 32-wide latent plus 16 rotary
# columns per token, one KV "head" shared by 8 query heads), a dense first
# layer then 4 routed experts and a shared one, and YaRN rotary embeddings,
# the only kind SGLang's CPU rotary path takes for this model. The MoE
# fields transformers does not declare are the ones SGLang reads from a real
# DeepSeek-V2 config. It needs MLA_ENV on every server (cpu_host/mla_torch_native.py).
_DEEPSEEK_V2 = ("num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=None, "
                "qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, "
                "num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1, moe_layer_freq=1, "
                "topk_method='greedy', scoring_func='softmax', n_group=1, topk_group=1, ep_size=1, "
                "initializer_range=0.5, rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, "
                "original_max_position_embeddings=1024, beta_fast=32, beta_slow=1, mscale=0.707, "
                "mscale_all_dim=0.707)")
TINY_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "num_attention_heads=4, num_key_value_heads=4"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _QWEN),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  f"{_QWEN}, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _DEEPSEEK_V2),
}
# MLA in the torch_native attention backend (cpu_host/mla_torch_native.py).
MLA_ENV = {"CPCACHE_TEST_MLA_TORCH_NATIVE": "1"}
_FAMILY_ENV = {"deepseek_v2": MLA_ENV}


def model_modules_env(model: Path) -> dict[str, str]:
    """Only the SGLang model modules of `model`'s architectures imported by
    its server's processes (`cpu_host/model_modules.py`): about 2 s of a
    start here. Nothing for a model without a config naming them."""
    try:
        architectures = json.loads((model / "config.json").read_text())["architectures"]
    except (OSError, ValueError, KeyError):
        return {}
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        return {}
    return {"CPCACHE_TEST_MODEL_ARCHS": ",".join(architectures)}


def family_env(family: str) -> dict[str, str]:
    """What every SGLang server of a model of `family` needs in its environment here."""
    return dict(_FAMILY_ENV.get(family, {}))


def make_tiny_model(path: Path, family: str = "llama") -> Path:
    """A 2-layer model of `family` (TINY_MODELS) with random weights."""
    config, model, extra = TINY_MODELS[family]
    script = (
        "import sys, torch\n"
        f"from transformers import {config}, {model}\n"
        "torch.manual_seed(0)\n"
        f"cfg = {config}(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        f"               max_position_embeddings=4096, {extra})\n"
        f"{model}(cfg).save_pretrained(sys.argv[1])\n")
    subprocess.run([sglang_interpreter(), "-c", script, str(path)], check=True, capture_output=True, timeout=300)
    return path


class Watched:
    """A child process whose output goes to a log file, read line by line on
    a thread that fires an event when a marker line appears."""

    def __init__(self, argv: list[str], log: Path, markers: Iterable[str], env: dict[str, str] | None = None) -> None:
        self.log = log
        self.lines: list[str] = []
        self.seen = {m: threading.Event() for m in markers}
        self.new_line = threading.Condition()
        self.exited = threading.Event()
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "a") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                with self.new_line:
                    self.lines.append(line)
                    self.new_line.notify_all()
                for marker, event in self.seen.items():
                    if marker in line:
                        event.set()
        self.proc.stdout.close()
        self.proc.wait()
        with self.new_line:
            self.exited.set()
            self.new_line.notify_all()
        for event in self.seen.values():
            event.set()  # wake every waiter: the process is gone

    def wait_for(self, marker: str, timeout_s: float) -> None:
        if not self.seen[marker].wait(timeout_s) or self.proc.poll() is not None and marker not in self.text():
            raise RuntimeError(f"{self.argv[:4]}: no {marker!r} within {timeout_s:g} s "
                               f"(exit {self.proc.poll()}); last output:\n{self.tail()}")

    def wait_lines(self, marker: str, count: int, timeout_s: float) -> list[str]:
        """Wait until `count` output lines hold `marker`: -> those lines."""
        def matching() -> list[str]:
            return [line for line in self.lines if marker in line]

        with self.new_line:
            if not self.new_line.wait_for(lambda: len(matching()) >= count or self.exited.is_set(), timeout_s) \
                    or len(matching()) < count:
                raise RuntimeError(f"{self.argv[:4]}: {len(matching())} of {count} {marker!r} lines within "
                                   f"{timeout_s:g} s (exit {self.proc.poll()}); last output:\n{self.tail()}")
            return matching()

    def lines_with(self, marker: str) -> list[str]:
        with self.new_line:
            return [line for line in self.lines if marker in line]

    def text(self) -> str:
        return "".join(self.lines)

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])

    def pause(self) -> None:
        """SIGSTOP the process and its children (its process group): an idle
        SGLang server's loops spin, and would take CPU from a measured one."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused process cannot act on SIGTERM
            except ProcessLookupError:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not self.exited.wait(timeout_s):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.exited.wait(timeout_s)


@dataclass
class Daemons:
    """`cpcache launch`: one daemon per rank, restarted when one dies."""

    run_dir: Path
    tp: int
    cp: int = 1
    dp: int = 1  # attention DP: one agreement domain per DP group
    settings: dict = field(default_factory=dict)
    per_rank: dict[int, dict] = field(default_factory=dict)  # rank -> settings of that rank only
    process: Watched | None = None

    @property
    def config(self) -> Path:
        """The domain's settings file (`cpcache launch --config`), written at start."""
        return self.run_dir.parent / f"{self.run_dir.name}.toml"

    def start(self, timeout_s: float = 120.0) -> Daemons:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> Daemons:
        """Start the launcher, not waiting for its daemons: a server started
        meanwhile waits for them at its attach (`start_timeout_s`), while both
        import and load."""
        config = self.config

        def table(settings: dict) -> str:
            return "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())

        config.write_text(table(self.settings) + "".join(f"[rank.{r}]\n{table(s)}" for r, s in self.per_rank.items()))
        self.process = Watched([str(CPCACHE), "launch", "--tp", str(self.tp), "--cp", str(self.cp),
                                "--dp", str(self.dp), "--run-dir", str(self.run_dir), "--config", str(config),
                                "--agreement-timeout", "10"],
                               self.run_dir.parent / f"{self.run_dir.name}.log", ["press Ctrl-C"])
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> Daemons:
        assert self.process is not None, "wait_ready before launch"
        self.process.wait_for("press Ctrl-C", timeout_s)
        return self

    def socket(self, rank: int) -> str:
        return str(self.run_dir / f"rank-{rank}.sock")

    def daemon_pid(self, rank: int) -> int:
        """The pid the launcher last reported for `rank`."""
        assert self.process is not None
        pid = None
        for line in self.process.lines:
            if line.startswith(f"rank {rank}: unix:") or line.startswith(f"cpcache: rank {rank} is back"):
                pid = int(line.split("pid ")[1].split(")")[0].split(",")[0])
        if pid is None:
            raise RuntimeError(f"rank {rank}: the launcher reported no pid")
        return pid

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class Server:
    """One `python -m sglang.launch_server`."""

    name: str
    model: Path
    work: Path
    flags: list[str]
    tp: int = 1
    cp: int = 1  # attention context parallelism: splits the TP ranks (--attn-cp-size)
    dp: int = 1  # attention data parallelism: splits them too (--enable-dp-attention --dp)
    page_size: int = 16
    device_tokens: int = 1024
    env: dict = field(default_factory=dict)
    tokenizer: bool = False  # serve text with the tokenizer saved beside the model (SGLang's bench client sends text)
    # SGLang's --sleep-on-idle: an idle scheduler otherwise spins a core. Set
    # on reference servers, whose spin would take that core from the server
    # under test, and where a test or bench serves with the flag on purpose;
    # servers under test otherwise keep SGLang's default loop.
    sleep_on_idle: bool = False
    port: int = 0
    process: Watched | None = None

    def argv(self) -> list[str]:
        cpu_flags = [f for f in CPU_FLAGS if not (self.tokenizer and f == "--skip-tokenizer-init")]
        return [sglang_interpreter(), "-m", "sglang.launch_server", "--model-path", str(self.model),
                *cpu_flags, "--tp", str(self.tp), "--page-size", str(self.page_size),
                "--max-total-tokens", str(self.device_tokens), "--host", "127.0.0.1", "--port", str(self.port),
                # In gRPC mode the server listens on --port, but SGLang checks
                # --grpc-port, which it takes for --port + 10000 when not given.
                *(["--grpc-port", str(self.port)] if "--smg-grpc-mode" in self.flags else []),
                *(["--attn-cp-size", str(self.cp)] if self.cp > 1 else []),
                *(["--enable-dp-attention", "--dp", str(self.dp)] if self.dp > 1 else []),
                *(["--sleep-on-idle"] if self.sleep_on_idle else []), *self.flags]

    def start(self) -> Server:
        self.port = self.port or free_port()
        # The caller's own PYTHONPATH follows cpu_host/: a source tree put there
        # (a worktree under test) is the cpcache that SGLang's processes import.
        path = os.pathsep.join(p for p in (str(CPU_HOST), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1", **NO_CRASH_DIAGNOSTICS,
               **(DP_ATTENTION_ENV if self.dp > 1 else {}), **model_modules_env(self.model), **self.env}
        if self.tp > 1:
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                  for i in range(self.tp)))
        self.process = Watched(self.argv(), self.work / f"{self.name}.log", [READY, "cpcache:"], env=env)
        return self

    def wait_ready(self, timeout_s: float = 300.0, port_tries: int = 3) -> Server:
        """Until the server serves. The free port it was given, or a port
        SGLang picks for its ranks, can be taken before it binds (by another
        server starting meanwhile): it starts again on other ports."""
        def settled(p: Watched) -> bool:
            return READY in p.text() or bind_failed(p.text()) or p.exited.is_set()

        for _ in range(port_tries):
            process = self.process
            assert process is not None
            with process.new_line:
                process.new_line.wait_for(functools.partial(settled, process), timeout_s)
            if not bind_failed(process.text()):
                break
            process.stop()
            self.port = free_port()
            self.start()
        assert self.process is not None
        self.process.wait_for(READY, timeout_s)
        return self

    def post(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data,
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
        return json.loads(raw) if raw.strip().startswith(b"{") else {"text": raw.decode()}

    def flush_cache(self, attempts: int = 10_000) -> int:
        """POST /flush_cache until SGLang takes it (it refuses while requests
        are queued or running): -> the refusals before it did."""
        for refused in range(attempts):
            try:
                self.post("/flush_cache")
                return refused
            except urllib.error.HTTPError as exc:
                if exc.code != 400:
                    raise
        raise RuntimeError(f"flush_cache refused {attempts} times")

    def generate(self, input_ids: list[int], max_new_tokens: int = 4, rid: str | None = None,
                 timeout_s: float = 120.0, dp_rank: int | None = None) -> Reply:
        """`dp_rank`: the attention DP group to serve it (SGLang's `routed_dp_rank`)."""
        body: dict = {"input_ids": input_ids, "return_logprob": True,
                      "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        if rid is not None:
            body["rid"] = rid
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        out = self.post("/generate", body, timeout_s=timeout_s)
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        finish = meta.get("finish_reason") or {}
        logprobs = meta.get("output_token_logprobs") or ()
        # A server with a tokenizer answers text: its token ids are in the logprobs.
        ids = out.get("output_ids") or [x[1] for x in logprobs]
        return Reply(tuple(ids), tuple(x[0] for x in logprobs),
                     meta.get("cached_tokens", 0), details.get("device", 0), details.get("host", 0),
                     details.get("storage", 0), finish.get("type", ""), float(meta.get("e2e_latency") or 0.0))

    def log_lines(self, marker: str) -> list[str]:
        assert self.process is not None
        return [line for line in self.process.lines if marker in line]

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def start_paused(servers: Iterable[Server], timeout_s: float = 300.0) -> None:
    """Start `servers` together, then pause each once it serves (SIGSTOP):
    a caller measuring them one at a time resumes one, the others off the CPU."""
    started = list(servers)
    for server in started:
        server.start()
    for server in started:
        server.wait_ready(timeout_s)
        assert server.process is not None
        server.process.pause()


@dataclass(frozen=True)
class Reply:
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached: int
    device: int
    host: int
    storage: int
    finish: str
    latency_s: float = 0.0  # SGLang's own e2e latency of the request (meta_info)


def same_outputs(a: Reply, b: Reply, tolerance: float = 1e-4) -> bool:
    """Greedy tokens equal and logprobs within float32 reduction noise."""
    return a.output_ids == b.output_ids and len(a.logprobs) == len(b.logprobs) and all(
        abs(x - y) <= tolerance for x, y in zip(a.logprobs, b.logprobs))
