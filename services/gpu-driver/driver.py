"""The GPU check as one command, for a GPU host lent for minutes with no
network: `bash services/gpu-driver/run.sh OUT_DIR`.

Runs the project from the source tree. In order, each with its own time
limit inside an overall deadline of about 8 minutes:

1. preflight: the interpreter, the packages the daemon and the tests need
   (the host's own, else wheels carried in services/gpu-driver/wheels/),
   the versions cpcache/v1's generated code requires, and a CUDA device;
   without one it stops here, within seconds;
2. tests/gpu under pytest (IPC attach, pinned host pool, bit-exact movers
   for every layout, a two-process domain on one GPU, a CUDA graph replayed
   while a daemon loads pages into its buffers, a load whose daemon is killed
   or stuck mid-copy finished by the scheduler); a skip counts as a failure;
3. device <-> host bandwidth of the movers against cudaMemcpyAsync of pinned
   memory (`cpcache bench movers --device-only`).

Writes one JSON summary, OUT_DIR/gpu-summary.json, whatever happened
(services/gpu-driver/README.md lists its keys), and exits with one of the
codes below.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

OK, FAILED, USAGE, NO_CUDA, MISSING, TIMED_OUT = 0, 1, 2, 3, 4, 5
SUMMARY = "gpu-summary.json"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS = HERE / "wheels"
DEADLINE_S = 470.0
LIMITS_S = {"probe": 60.0, "tests": 300.0, "bench": 120.0}
TAIL = 4000  # characters of a failed phase's output kept in the summary
MIN_PYTHON = (3, 11)

# Which check each test of tests/gpu is, by the start of its name.
CHECKS = {
    "test_host_pool_is_pinned": "pinned_host_pool",
    "test_device_host_movers_are_bit_exact": "movers_bit_exact",
    "test_cuda_ipc_attach_": "ipc_attach",
    "test_two_process_domain_on_one_gpu": "two_process_domain",
    "test_cuda_graph_": "cuda_graph",
    "test_overlapped_load_back_": "overlapped_load_back",
    "test_a_load_whose_daemon_is_killed_mid_copy_on_a_gpu": "orphaned_load_finished",
    "test_a_gpu_load_whose_daemon_is_stuck": "orphaned_load_finished",
}

PROBE = """
import json, torch
info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "available": torch.cuda.is_available()}
if info["available"]:
    p = torch.cuda.get_device_properties(0)
    info.update(devices=torch.cuda.device_count(), name=p.name, capability=f"{p.major}.{p.minor}",
                memory_gib=round(p.total_memory / 2**30, 1))
print(json.dumps(info))
"""


class Stop(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Run:
    """One run of the check: its summary, its scratch folder, its clock."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.monotonic()
        self.scratch = Path(tempfile.mkdtemp(prefix="cpcache-gpu-"))
        self.site = self.scratch / "site"
        self.summary: dict = {"ok": False, "exit_code": None, "failure": None,
                              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "host": {"python": platform.python_version(), "platform": platform.platform()},
                              "phases_s": {}}

    def env(self) -> dict[str, str]:
        paths = [str(self.site), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1",
                "CPCACHE_GPU_FIGURES": str(self.scratch / "figures.json")}

    def phase(self, name: str, argv: list[str]) -> subprocess.CompletedProcess:
        """Run one phase's command within its limit and what is left of the deadline."""
        left = DEADLINE_S - (time.monotonic() - self.started)
        limit = min(LIMITS_S[name], left)
        if limit <= 0:
            raise Stop(TIMED_OUT, f"{name}: no time left of the {DEADLINE_S:.0f} s deadline")
        print(f"gpu check: {name} (at most {limit:.0f} s)", flush=True)
        start = time.monotonic()
        stdout, stderr = self.scratch / f"{name}.out", self.scratch / f"{name}.err"
        # A process group of its own, ended when the phase is: no daemon a
        # test started outlives it (and holds the GPU) or keeps its output open.
        with open(stdout, "w") as out, open(stderr, "w") as err:
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env(), stdout=out, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                pass
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.summary["phases_s"][name] = round(time.monotonic() - start, 1)
        # Whatever bytes a crash left there, the summary still gets its tail.
        done = subprocess.CompletedProcess(argv, proc.returncode, stdout.read_text(errors="replace"),
                                           stderr.read_text(errors="replace"))
        if time.monotonic() - start >= limit:
            self.summary[f"{name}_output_tail"] = (done.stdout + done.stderr)[-TAIL:]
            raise Stop(TIMED_OUT, f"{name}: ran past its {limit:.0f} s limit")
        return done

    def finish(self, code: int, failure: str | None) -> int:
        self.summary.update(ok=code == OK, exit_code=code, failure=failure,
                            wall_s=round(time.monotonic() - self.started, 1))
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / SUMMARY).write_text(json.dumps(self.summary, indent=2) + "\n")
        shutil.rmtree(self.scratch, ignore_errors=True)
        print(f"{'PASS' if code == OK else 'FAIL'} (exit {code}): {failure or 'every check passed'}; "
              f"summary in {self.out / SUMMARY}", flush=True)
        return code


def preflight(run: Run) -> None:
    if sys.version_info < MIN_PYTHON:
        raise Stop(MISSING, f"Python {platform.python_version()} is too old: cpcache needs >= 3.11")
    try:
        import dependencies
    except ImportError as exc:  # `packaging` comes with pytest: without it there is no test runner either
        raise Stop(MISSING, f"cannot check the packages: {exc}; install pytest (which brings packaging)") from None
    choices = dependencies.resolve(dependencies.roots(REPO),
                                   dependencies.carried_wheels(WHEELS))
    run.summary["packages"] = [c.report() for c in choices]
    gencode = dependencies.gencode_minimums(REPO)
    run.summary["gencode_minimums"] = gencode
    run.summary["versions"] = {c.name: c.version for c in choices if c.name in ("grpcio", "protobuf", "torch")}

    torch = next(c for c in choices if c.name == "torch")
    if torch.origin == "missing":
        found = f"torch {torch.host} does not meet {torch.required}" if torch.host else "torch is not installed"
        raise Stop(MISSING, f"{found}: the GPU check needs the host's CUDA build of torch")
    # CUDA first: without a device nothing else matters, and the message says so.
    probe = run.phase("probe", [sys.executable, "-c", PROBE])
    if probe.returncode != 0:
        run.summary["probe_output_tail"] = (probe.stdout + probe.stderr)[-TAIL:]
        raise Stop(NO_CUDA, "no CUDA device: torch did not import or crashed probing CUDA (probe_output_tail)")
    cuda = json.loads(probe.stdout.strip().splitlines()[-1])
    run.summary["cuda"] = cuda
    if not cuda["available"]:
        build = f"a CUDA {cuda['torch_cuda']} build" if cuda["torch_cuda"] else "a CPU-only build"
        raise Stop(NO_CUDA, f"no CUDA device: torch {cuda['torch']} ({build}) sees no GPU on this host; "
                            "run this on a CUDA host (the GPU tests need one)")

    missing = [c for c in choices if c.origin == "missing"]
    if missing:
        listed = ", ".join(f"{c.name}{c.required} (host: {c.host or 'none'})" for c in missing)
        raise Stop(MISSING, f"missing or too old, and no wheel carried for them: {listed}; "
                            "fill services/gpu-driver/wheels with services/gpu-driver/fetch-wheels.sh on a host "
                            "with a package index, and carry that folder")
    dependencies.unpack(choices, run.site)


def gpu_tests(run: Run) -> None:
    junit = run.scratch / "junit.xml"
    done = run.phase("tests", [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={junit}"])
    tests = junit_outcomes(junit) if junit.exists() else []
    checks: dict[str, bool] = {}
    for test in tests:
        check = next((c for prefix, c in CHECKS.items() if test["name"].startswith(prefix)), "other")
        checks[check] = checks.get(check, True) and test["outcome"] == "passed"
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    run.summary["tests"] = {"counts": counts, "checks": checks, "cases": tests, "pytest_exit": done.returncode}
    figures = run.scratch / "figures.json"  # the overlapped load-back's times, written by its test
    run.summary["overlapped_load_back"] = json.loads(figures.read_text()) if figures.exists() else None
    if done.returncode != 0 or not tests or counts["passed"] != len(tests) or set(CHECKS.values()) - set(checks):
        run.summary["tests_output_tail"] = (done.stdout + done.stderr)[-TAIL:]
        raise Stop(FAILED, f"tests/gpu: {counts} (pytest exit {done.returncode}; a skip counts as a failure "
                           "on a GPU host)")


def junit_outcomes(junit: Path) -> list[dict]:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        out.append({"name": case.get("name", ""), "outcome": outcome, "seconds": float(case.get("time", 0))})
    return out


def bandwidth(run: Run) -> None:
    done = run.phase("bench", [sys.executable, "-m", "cpcache.tools.cli", "bench", "movers", "--json",
                               "--device-only"])
    if done.returncode != 0:
        run.summary["bench_output_tail"] = (done.stdout + done.stderr)[-TAIL:]
        raise Stop(FAILED, f"bench movers --device-only exited {done.returncode}")
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # no report: say what it printed instead
        run.summary["bench_output_tail"] = (done.stdout + done.stderr)[-TAIL:]
        raise Stop(FAILED, "bench movers --device-only printed no JSON report") from None
    run.summary["bandwidth"] = report


def main(argv: list[str]) -> int:
    target = argv[0] if argv else os.environ.get("OUT", "")
    if not target:
        print("usage: run.sh OUT_DIR (or set OUT): the folder the JSON summary goes to", file=sys.stderr)
        return USAGE
    run = Run(Path(target))
    try:
        preflight(run)
        gpu_tests(run)
        bandwidth(run)
    except Stop as stop:
        return run.finish(stop.code, str(stop))
    except Exception as exc:  # a bug here is still a summary and a failing exit
        return run.finish(FAILED, f"the driver failed: {type(exc).__name__}: {exc}")
    return run.finish(OK, None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
