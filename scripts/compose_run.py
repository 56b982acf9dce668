"""Run compose.yaml's `cpu` profile once and check it (scripts/compose-test.sh
prepares and builds first; this needs the image). Standard library only, so
it runs with the system's python3 beside podman-compose.

1. Clears what an earlier run may have left, then `podman-compose up -d` of
   the profile's services (named explicitly: Debian's podman-compose 1.0.3
   knows no profiles and does not wait on `service_healthy`, so the driver
   waits on each daemon's health itself, and this script runs each
   container's own healthcheck once the driver saw every rank serving).
2. Follows the driver's JSON lines (cpcache/testing/compose_driver.py):
   `serving`, `replay` (0 divergences, identical decision logs, 0 corrupt
   loads, some hits from storage: pages one container wrote, another
   found), `ready-for-kill`. With Mooncake storage (the default), the
   master's log must show one segment per daemon, each mounted at its own
   container's name; it also says whether the store ran full.
3. Kills one daemon container (SIGKILL), writes `RANK KILLED_AT` into the
   driver's FIFO (through the volume's mount point, else `podman exec`),
   and takes the driver's `kill` line: every survivor answered UNAVAILABLE
   naming that rank, and how long after the kill.
4. Always: `podman-compose down -v`, the project's network removed, and a
   check that no container, volume or network of the project is left.

Prints one JSON summary on stdout (and to --json-out); exit 0 when it all
passed. Every wait has a deadline; nothing sleeps.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "compose.yaml"


def log(message: str) -> None:
    print(f"compose-run: {message}", file=sys.stderr, flush=True)


def run(*cmd: str, timeout: float = 120, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check and result.returncode != 0:
        output = result.stdout[-2000:] + result.stderr[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}:\n{output}")
    return result


def _seconds(duration: str) -> float:
    """A compose duration ("5s", "1m30s", "250ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    return sum(float(number) * units[unit] for number, unit in parts)


def rank_states(stack: Stack, ranks: int = 4) -> dict[int, tuple[str, int]]:
    """Each daemon's (state, epoch), from `cpcache status` in its container."""
    states = {}
    for rank in range(ranks):
        out = run("podman", "exec", stack.container(f"cpu-rank-{rank}"), "cpcache", "status",
                  f"/run/cpcache/rank-{rank}.sock", timeout=60, check=False)
        try:
            status = json.loads(out.stdout)
            states[rank] = (status.get("state", "?"), int(status.get("epoch", 0)))
        except ValueError:
            states[rank] = ("unreachable", -1)
    return states


def reform(stack: Stack, victim: str, deadline: float) -> dict:
    """Start the killed daemon's container again (what compose's restart
    policy or an operator does) and wait, each check a `cpcache status` per
    rank, until every rank serves in a later epoch: the domain re-forms with
    nobody touching the survivors."""
    started = time.time()
    run("podman", "start", victim, timeout=120)
    states: dict[int, tuple[str, int]] = {}
    while time.monotonic() < deadline:
        states = rank_states(stack)
        if all(state == "serving" and epoch >= 1 for state, epoch in states.values()):
            break
    passed = bool(states) and all(state == "serving" and epoch >= 1 for state, epoch in states.values())
    return {"states": {str(r): list(v) for r, v in states.items()}, "after_start_s": round(time.time() - started, 2),
            "passed": passed}


def mooncake_master_report(log_text: str) -> dict:
    """What the Mooncake master's log says about the run: the segments the
    daemons mounted (each must be named by its own container, the address
    the others reach it at), and whether the store ran full (evictions, puts
    refused for space): a store smaller than what the slice writes loses the
    pages the host pool evicted, and storage hits with them."""
    segments = sorted(set(re.findall(r"action=mount_segment, segment_name=(\S+)", log_text)))
    return {"segments": segments,
            "evictions": len(re.findall(r"\[EVICT-RESULT\]", log_text)),
            "puts_refused_for_space": len(re.findall(r"BatchPutStart failed for \d+ keys due to insufficient space",
                                                      log_text))}


def profile_services(profile: str) -> list[str]:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    return [name for name, svc in services.items() if profile in svc.get("profiles", [])]


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.project = args.project
        self.services = profile_services("cpu")
        self.compose = ["podman-compose", "-p", self.project, "-f", str(COMPOSE_FILE)]

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"  # podman-compose's naming

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.project}"
        found = {
            "containers": run("podman", "ps", "-a", "-q", "--filter", label).stdout.split(),
            "volumes": run("podman", "volume", "ls", "-q", "--filter", label).stdout.split(),
            "networks": [n for n in run("podman", "network", "ls", "--format", "{{.Name}}").stdout.split()
                         if n == f"{self.project}_default"],
        }
        return {kind: names for kind, names in found.items() if names}

    def down(self) -> None:
        run(*self.compose, "down", "-v", *self.services, timeout=180, check=False)
        label = f"label=io.podman.compose.project={self.project}"
        for volume in run("podman", "volume", "ls", "-q", "--filter", label).stdout.split():
            run("podman", "volume", "rm", "-f", volume, check=False)
        run("podman", "network", "rm", "-f", f"{self.project}_default", check=False)

    def up(self) -> None:
        env = dict(os.environ, CPCACHE_COMPOSE_REQUESTS=str(self.args.requests))
        run(*self.compose, "up", "-d", "--no-build", *self.services, timeout=300, env=env)

    def healthchecks(self) -> dict[str, str]:
        """Each service's own healthcheck, run by hand (podman runs them on
        systemd timers, which this machine kind lacks) with podman's rule:
        a service is unhealthy only once `retries` checks in a row failed,
        over at least `retries` x `interval` (one check can miss its
        client's deadline while the replay starts on a loaded host). A
        service that stays unhealthy is reported with what its check
        printed, which `podman healthcheck run` does not show."""
        definitions = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
        out = {}
        for service in self.services:
            check = definitions[service].get("healthcheck")
            if check:
                out[service] = self._healthcheck(service, check)
        return out

    def _healthcheck(self, service: str, check: dict) -> str:
        retries = int(check.get("retries", 3))
        window = retries * _seconds(str(check.get("interval", "30s")))
        started, failures, last = time.monotonic(), 0, ""
        while failures < retries or time.monotonic() - started < window:
            try:
                result = run("podman", "healthcheck", "run", self.container(service), timeout=60, check=False)
            except subprocess.TimeoutExpired:
                failures, last = failures + 1, "`podman healthcheck run` did not return in 60 s"
                continue
            if result.returncode == 0:
                return "healthy"
            failures, last = failures + 1, (result.stdout + result.stderr).strip()
        test = check["test"]
        command = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else list(test[1:])
        try:
            shown = run("podman", "exec", self.container(service), *command, timeout=60, check=False)
            printed = f"exited {shown.returncode}: {(shown.stdout + shown.stderr).strip()[-1500:]}"
        except subprocess.TimeoutExpired:
            printed = "did not return in 60 s"
        return f"unhealthy after {failures} checks ({last}); `{' '.join(command)}` run once more {printed}"

    def tail(self, service: str, lines: int = 40) -> str:
        result = run("podman", "logs", "--tail", str(lines), self.container(service), check=False)
        return result.stdout + result.stderr

    def fifo_writer(self, fifo: str) -> tuple[str, str]:
        """How to reach the driver's FIFO: its host path through the volume's
        mount point (rootful podman), else `podman exec` in the driver."""
        mount = run("podman", "volume", "inspect", "--format", "{{.Mountpoint}}", f"{self.project}_cpu-run",
                    check=False).stdout.strip()
        host_path = Path(mount) / Path(fifo).relative_to("/run/cpcache") if mount else None
        if host_path and os.access(host_path, os.W_OK):
            return "host", str(host_path)
        return "exec", fifo


class Lines:
    """The driver's stdout, line by line, read by a thread; its stderr
    (progress) is passed through."""

    def __init__(self, container: str) -> None:
        self.proc = subprocess.Popen(["podman", "logs", "-f", container], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._pass_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.queue.put(line)
        self.queue.put(None)

    def _pass_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write("  driver| " + line)

    def record(self, phase: str, deadline: float) -> dict:
        """The driver's next JSON record, which must be `phase`."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the driver printed no {phase!r} record in time")
            try:
                line = self.queue.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"the driver printed no {phase!r} record in time") from None
            if line is None:
                raise RuntimeError(f"the driver ended before its {phase!r} record")
            line = line.strip()
            if not line.startswith("{"):
                sys.stderr.write(f"  driver| {line}\n")
                continue
            record = json.loads(line)
            if record.get("phase") != phase:
                raise RuntimeError(f"the driver printed {record.get('phase')!r} where {phase!r} was due: {line}")
            return record

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--project", default="cpcache")
    p.add_argument("--requests", type=int, default=200, help="trace requests the driver replays")
    p.add_argument("--kill-rank", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=900, help="for the whole run, build excluded")
    p.add_argument("--build-s", type=float, default=-1, help="how long the build took (for the summary)")
    p.add_argument("--json-out", help="also write the summary here")
    p.add_argument("--keep", action="store_true", help="leave the stack up on failure, to look at it")
    args = p.parse_args()
    stack = Stack(args)
    deadline = time.monotonic() + args.deadline_s
    summary: dict = {"build_s": args.build_s, "services": stack.services, "passed": False}
    started = time.monotonic()
    lines: Lines | None = None
    try:
        stack.down()  # what an earlier run may have left
        log(f"up: {' '.join(stack.services)}")
        stack.up()
        summary["up_s"] = round(time.monotonic() - started, 1)
        lines = Lines(stack.container("cpu-driver"))
        serving = lines.record("serving", deadline)
        summary["serving_s"] = round(time.monotonic() - started, 1)
        if not serving["passed"]:
            raise RuntimeError(f"the daemons did not serve: {serving}")
        summary["healthchecks"] = stack.healthchecks()
        log(f"every rank serves ({summary['serving_s']} s after up); healthchecks {summary['healthchecks']}")
        replay = lines.record("replay", deadline)
        summary["replay"] = {k: replay[k] for k in (
            "ranks", "topology", "storage", "requests", "steps", "decisions", "divergences", "identical_decision_logs",
            "corrupt_loads", "loaded_pages", "hit_rate", "hit_rate_ceiling", "pages_moved_rank0", "round_latency_us",
            "wall_s", "passed")
            if k in replay}
        log(f"replay: {json.dumps(summary['replay'])}")
        if not replay["passed"]:
            raise RuntimeError("the replay failed its checks")
        # Pages one rank wrote are found by the others, across containers:
        # some of the slice's hits must come from storage.
        summary["storage_hits"] = replay["hit_rate"]["storage"] > 0
        if replay["storage"] == "mooncake":
            report = mooncake_master_report(stack.tail("cpu-master", lines=100000))
            # Each daemon mounted one segment, at its own container's name.
            report["segment_per_daemon"] = sorted(name.rsplit(":", 1)[0] for name in report["segments"]) == [
                f"cpu-rank-{rank}" for rank in range(replay["ranks"])]
            summary["mooncake"] = report
            log(f"mooncake: {json.dumps(report)}")
            summary["storage_hits"] = summary["storage_hits"] and report["segment_per_daemon"]
        ready = lines.record("ready-for-kill", deadline)
        how, path = stack.fifo_writer(ready["fifo"])
        victim = stack.container(f"cpu-rank-{args.kill_rank}")
        fh = open(path, "w") if how == "host" else None  # noqa: SIM115 (the driver holds the read end open)
        killed_at = time.time()
        run("podman", "kill", "--signal", "KILL", victim, timeout=60)
        summary["kill_command_s"] = round(time.time() - killed_at, 3)
        notice = f"{args.kill_rank} {killed_at}\n"
        if fh is not None:
            fh.write(notice)
            fh.close()
        else:
            run("podman", "exec", stack.container("cpu-driver"), "sh", "-c", 'printf %s "$1" > "$2"', "sh",
                notice, path, timeout=60)
        kill = lines.record("kill", deadline)
        summary["kill"] = kill
        code = run("podman", "wait", stack.container("cpu-driver"), timeout=max(1, deadline - time.monotonic()))
        summary["driver_exit"] = int(code.stdout.strip() or -1)
        victim_state = run("podman", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", victim).stdout
        summary["killed_container"] = victim_state.strip()
        summary["reform"] = reform(stack, victim, deadline)
        log(f"re-form: {json.dumps(summary['reform'])}")
        summary["passed"] = bool(replay["passed"] and summary["storage_hits"] and kill["passed"]
                                 and summary["driver_exit"] == 0
                                 and summary["reform"]["passed"]
                                 and all(v == "healthy" for v in summary["healthchecks"].values()))
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        summary["error"] = str(exc)
        log(f"FAILED: {exc}")
        for service in stack.services:
            sys.stderr.write(f"---- {service}\n{stack.tail(service)}\n")
    finally:
        if lines is not None:
            lines.close()
        summary["run_s"] = round(time.monotonic() - started, 1)
        if args.keep and not summary["passed"]:
            log("--keep: the stack is left up")
        else:
            stack.down()
            summary["left_over"] = stack.leftovers()
            if summary["left_over"]:
                summary["passed"] = False
                log(f"left over after down: {summary['left_over']}")
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    log("PASSED" if summary["passed"] else "FAILED")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
