"""docs/sglang.md's recipes, run as the page prints them: each marked shell
block (`<!-- recipe: NAME -->` before a fenced `sh` block) is split into
its commands, and the commands run in one directory as a shell would run
them, each command ending in `&` a process of its own (its own process
group, its output in a log of its own) with every line before it (the
settings files written, the variables exported) run first in its shell.

What a test changes, and only that (`Substitutions`): the page's models
become the suite's tiny ones, its ports free ones, `/path/to/cpcache` this
checkout; `python`, `cpcache` and `mooncake_master` are SGLang's
environment's (first on PATH). The CPU host's lines (the `cpu-host`
recipe) run before a recipe and its flags are added where the page says
(`on_cpu_host`).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cpcache.testing.ports import free_port
from cpcache.testing.sglang_cpu.servers import NO_CRASH_DIAGNOSTICS, SGLANG_PYTHON, Watched

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "sglang.md"
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```sh\n(.*?)\n```", re.S)
HEREDOC = re.compile(r"<<'?(\w+)'?\s*$")
# What each kind of process prints once it serves (a master is waited on at its ports).
READY = {"cpcache launch": "press Ctrl-C", "sglang.launch_server": "The server is fired up and ready to roll",
         "sglang_router": "Uvicorn running on"}
# The page's models, and the suite's tiny model of the same family that stands in for each.
MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "llama", "Qwen/Qwen3-8B": "qwen3",
          "deepseek-ai/DeepSeek-V2-Lite": "deepseek_v2"}
# Every port the recipes name.
PORTS = (30000, 30001, 30002, 8000, 8998, 50051, 8080, 9003, 29600, 29601)


def recipes(page: Path = PAGE) -> dict[str, str]:
    """Each marked block of `page`, by its name."""
    return dict(RECIPE.findall(page.read_text()))


@dataclass(frozen=True)
class Command:
    text: str
    background: bool  # ends in `&`: a process that stays

    @property
    def kind(self) -> str:
        """Which program it runs: a key of READY, or `mooncake_master`."""
        for kind in (*READY, "mooncake_master"):
            if kind in self.text:
                return kind
        return ""


def commands(block: str) -> list[Command]:
    """The block's commands in order: continued lines joined, a heredoc
    kept whole with its command."""
    lines = block.splitlines()
    out: list[Command] = []
    i = 0
    while i < len(lines):
        text = lines[i]
        heredoc = HEREDOC.search(text)
        if heredoc:
            end = lines.index(heredoc[1], i + 1)
            out.append(Command("\n".join(lines[i:end + 1]), False))
            i = end + 1
            continue
        while text.endswith("\\"):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        if text.strip() and not text.lstrip().startswith("#"):
            background = text.rstrip().endswith("&") and not text.rstrip().endswith("&&")
            out.append(Command(text.rstrip().removesuffix("&").rstrip() if background else text, background))
    return out


def on_cpu_host(command: Command) -> Command:
    """The flags the page's "On a CPU host" adds to a server's line: every
    server `$CPU_FLAGS`, both PD servers `$CPU_PD_FLAGS`, the decode server
    `$CPU_DECODE_FLAGS` last."""
    if command.kind != "sglang.launch_server":
        return command
    extra = " $CPU_FLAGS"
    if "--disaggregation-mode" in command.text:
        extra += " $CPU_PD_FLAGS"
    if "--disaggregation-mode decode" in command.text:
        extra += " $CPU_DECODE_FLAGS"
    return Command(command.text + extra, command.background)


@dataclass
class Substitutions:
    """What a test must change in a recipe: models, ports, the checkout."""

    models: Mapping[str, Path]  # the page's model -> a tiny model
    ports: dict[int, int] = field(default_factory=dict)  # the page's port -> a free one
    server_flags: str = ""  # appended to every server's line (what a tiny model needs)

    def port(self, page_port: int) -> int:
        if page_port not in self.ports:
            self.ports[page_port] = free_port()
        return self.ports[page_port]

    def apply(self, text: str) -> str:
        for name, path in self.models.items():
            text = text.replace(name, str(path))
        text = re.sub(r"(?<![\w.])(" + "|".join(map(str, PORTS)) + r")(?!\d)",
                      lambda m: str(self.port(int(m[1]))), text)
        return text.replace("/path/to/cpcache", str(ROOT))


class Run:
    """One recipe's processes, started in `work` as a shell would start them
    (with the CPU host's lines first); `stop` ends them, last first."""

    def __init__(self, work: Path, block: str, cpu_host: str, subs: Substitutions) -> None:
        self.work = work
        self.subs = subs
        self.env = {**os.environ, **NO_CRASH_DIAGNOSTICS,
                    "PATH": f"{SGLANG_PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.preamble = [subs.apply(c.text) for c in commands(cpu_host)]
        self.steps = [on_cpu_host(c) for c in commands(block)]
        self.processes: list[tuple[Command, Watched]] = []

    def start(self) -> Run:
        for command in self.steps:
            text = self.subs.apply(command.text)
            if not command.background:
                self.preamble.append(text)
                continue
            if command.kind == "sglang.launch_server":
                text += self.subs.server_flags
            script = "\n".join(["set -e", f"cd {self.work}", *self.preamble, text])
            log = self.work / f"{len(self.processes)}-{command.kind.replace(' ', '-') or 'process'}.log"
            process = Watched(["bash", "-c", script], log, READY.values(), env=self.env)
            self.processes.append((command, process))
            if command.kind == "mooncake_master":  # the daemons' segment owner connects to it at once
                for page_port in (50051, 8080):
                    wait_accepts(self.subs.port(page_port), process)
        return self

    def of_kind(self, kind: str) -> list[Watched]:
        return [p for c, p in self.processes if c.kind == kind]

    def wait_ready(self, timeout_s: float = 600.0) -> Run:
        for command, process in self.processes:
            if command.kind in READY:
                process.wait_for(READY[command.kind], timeout_s)
        return self

    def sockets(self, run_dir: str) -> Iterator[Path]:
        yield from sorted((self.work / run_dir).glob("rank-*.sock"))

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            process.stop()


def wait_accepts(port: int, process: Watched, timeout_s: float = 60.0) -> None:
    """Until `port` on loopback takes a connection, or `process` exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1.0).close()
            return
        except OSError:
            if process.exited.wait(0.05):  # its exit, or 50 ms: then try again
                raise RuntimeError(f"exited before port {port} listened:\n{process.tail()}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port} after {timeout_s:g} s:\n{process.tail()}") \
                    from None
