"""`cpcache bench chaos`: one agreement domain of real daemons (`LocalDomain`:
real processes, real gloo, real gRPC on unix sockets) driven by one
simulated scheduler per rank, under faults at random moments and in
combination (chaos_faults.py), every rank's outcome compared step by step
(docs/design.md rule 12: a daemon's fate is never the server's).

Each rank's scheduler runs in its own thread and drives its daemon as the
SGLang backend does: the blocking `Client` constructed with `peers=` (the
other ranks' sockets, where it asks `Outcome` when its own daemon died before
answering), a `SchedulerSession` per attach, each step sent with
`step_later` and its reply taken after (as `SchedulerSession.iterate`).
The schedulers move in lockstep, one iteration at a time (a barrier stands
for the model's collectives in the forward, which hold SGLang's ranks
together), and every rank builds the same step at the same iteration from
agreed facts alone (the session's state, the iteration number): votes with
rank-dependent values (MIN and MAX; each rank checks the agreed value),
write-throughs, load-backs of pages the host pool holds, prefetches and
polls and revokes.

After a failed step a rank is detached (no tiers) and tries to attach again
at absolute iterations, as the backend's `CpcacheRadixCache` does
(`AttachTries`: a try at the next multiple of the wait, skipped while a
daemon of the domain does not serve, the wait doubled after a failed try;
the try is an `Attach` then the session's first, empty step, whose outcome
is the try's).

Each rank records, per iteration, what it sent and how it ended: the reply's
bytes (their digest) or the error's class. Checked afterwards:

- divergences: an iteration where ranks that sent a step got different
  outcomes (one a reply, another an error, or two different replies), or an
  attach try that attached some ranks and not others, each with the ranks,
  their outcomes and the faults that came before it;
- hangs: a call (step, attach) that did not return within `hang_s`, or the
  ranks never meeting again at an iteration;
- the iterations each rank fell back and attached again, compared;
- wrong decisions: an agreed vote other than the MIN or MAX of every rank's value.

Exit status 0 iff no divergence and no hang (nor a wrong decision, nor an
error of the harness itself).

Here: the run and the command line. The run's settings and its domain:
chaos_config.py; one rank's scheduler and what it records: chaos_rank.py;
the reading of the records and the report: chaos_report.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cpcache.client import Client
from cpcache.client.connection import DEADLINE_MARGIN_S, check_deadline
from cpcache.client.core import OUTCOME_WAIT_S
from cpcache.errors import CacheError, InvalidArgument
from cpcache.testing.chaos_config import ChaosConfig, domain_spec
from cpcache.testing.chaos_faults import COMBINED, KINDS, DomainHost, Injector
from cpcache.testing.chaos_rank import ChaosRank
from cpcache.testing.chaos_report import compare, differences, text_report, with_episodes


class ChaosRun:
    def __init__(self, cfg: ChaosConfig, run_dir: Path) -> None:
        if len(cfg.topology.domains()) != 1:
            raise InvalidArgument(f"chaos: --tp {cfg.tp} --cp {cfg.cp} is more than one agreement domain")
        check_deadline(cfg.call_timeout_s, cfg.agreement_timeout_s)
        self.cfg = cfg
        self.run_dir = run_dir
        self.ranks = cfg.topology.world_size
        self.hang_s = cfg.hang_s or cfg.call_timeout_s * (2 + self.ranks) + OUTCOME_WAIT_S + 30
        self.host = DomainHost(domain_spec(cfg, run_dir))
        self.aborted = threading.Event()
        self.iteration = 0
        self.phase = "run"  # then "settle" (no more faults), then "stop"
        self.settled = False
        self.hangs: list[dict[str, Any]] = []
        self.harness_errors: list[str] = []
        self._next_at = 0.0
        self._deadline = 0.0
        self._settle_until = 0.0
        self._aborted_at = 0.0
        self.began = time.time()

    def _between(self) -> None:
        """Between two iterations, every rank waiting (the barrier's action):
        paces the iterations and decides, for every rank alike, what comes next."""
        now = time.monotonic()
        if self._next_at > now:
            time.sleep(self._next_at - now)  # an iteration lasts at least iteration_ms, as a forward pass does
        now = time.monotonic()
        self._next_at = now + self.cfg.iteration_ms / 1000
        self.iteration += 1
        if self.phase == "run" and now >= self._deadline:
            self.phase = "settle"
            self.injector.halt.set()
            self._settle_until = now + self.cfg.settle_s
        elif self.phase == "settle":
            quiet = not self.injector.is_alive() and not any(r.pause_pending() for r in self.schedulers)
            self.settled = quiet and all(r.session is not None for r in self.schedulers)
            if self.settled or now >= self._settle_until:
                self.phase = "stop"

    def _loop(self, rank: ChaosRank) -> None:
        try:
            while True:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    if not self.aborted.is_set():
                        self._hang(rank, "the ranks did not meet at the next iteration", self.barrier_s)
                    return
                if self.phase == "stop":
                    return
                rank.iterate(self.iteration)
        except Exception as exc:  # a bug of the harness
            self.harness_errors.append(f"rank {rank.rank} at iteration {self.iteration}: {type(exc).__name__}: {exc}")
            self.abort()

    def abort(self) -> None:
        self.aborted.set()
        self.phase = "stop"
        self.barrier.abort()

    def _hang(self, rank: ChaosRank, what: str, seconds: float) -> None:
        self.hangs.append({"rank": rank.rank, "iteration": self.iteration, "what": what,
                           "seconds": round(seconds, 1), "t_s": round(time.time() - self.began, 2)})

    def execute(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.monotonic()
        self.host.start()
        ready_s = time.monotonic() - started
        self.schedulers = [ChaosRank(cfg, r, self.host.sockets, self.aborted) for r in range(self.ranks)]
        self.barrier_s = self.hang_s + 1.3 * cfg.call_timeout_s + 30
        self.barrier = threading.Barrier(self.ranks, action=self._between, timeout=self.barrier_s)
        self.injector = Injector(self.host, seed=cfg.seed, kinds=cfg.kinds, every_s=cfg.fault_every_s,
                                 agreement_s=cfg.agreement_timeout_s, call_timeout_s=cfg.call_timeout_s,
                                 pause_scheduler=lambda r, where, s: self.schedulers[r].pause(where, s),
                                 iteration=lambda: self.iteration, flood_streams=cfg.flood_streams,
                                 flood_calls=cfg.flood_calls)
        threads = [threading.Thread(target=self._loop, args=(r,), name=f"chaos-rank-{r.rank}", daemon=True)
                   for r in self.schedulers]
        self.began = time.time()
        self._deadline = time.monotonic() + cfg.minutes * 60
        for thread in threads:
            thread.start()
        self.injector.start()
        flagged: set[tuple[int, float]] = set()
        try:
            while any(t.is_alive() for t in threads):
                for thread in threads:
                    thread.join(0.25)
                now = time.monotonic()
                if self.aborted.is_set():
                    self._aborted_at = self._aborted_at or now
                    if now - self._aborted_at > 15:  # a hung call's thread is left behind
                        break
                for rank in self.schedulers:
                    since = rank.busy_since
                    if since is not None and now - since > self.hang_s and (rank.rank, since) not in flagged:
                        flagged.add((rank.rank, since))
                        self._hang(rank, rank.busy_what, now - since)
                        self.abort()
            ran_s = time.time() - self.began
            at_end = self._daemons_now()
        finally:
            self.injector.halt.set()
            self.injector.join(cfg.call_timeout_s * 3 + 30)
            codes = self.host.stop()
            for rank in self.schedulers:
                rank.close()
        report = self.report(ran_s, ready_s)
        report["daemons_at_end"] = at_end
        report["daemon_exit_codes_at_stop"] = codes
        if not self.settled:
            # The faults ended settle_s ago and some rank is still without
            # tiers: its domain did not serve again (a hang of the tiers).
            why = {str(r.rank): r.last_skip for r in self.schedulers if r.session is None}
            report["hang_list"].append({"rank": -1, "iteration": self.iteration, "t_s": round(ran_s, 2),
                                        "what": f"ranks {report['without_tiers_s']['still_without_at_end']} not "
                                                f"attached again {cfg.settle_s:g} s after the last fault; last "
                                                f"skipped tries: {why}", "seconds": cfg.settle_s})
            report["hangs"] = len(report["hang_list"])
            report["ok"] = False
        return report

    def _daemons_now(self) -> dict[str, Any]:
        """Each daemon's health, state and epoch, as the run ends."""
        from cpcache.testing.daemon_probe import what_is_open

        out: dict[str, Any] = {}
        for rank, socket in enumerate(self.host.sockets):
            with Client(socket, timeout_s=2.0) as daemon:
                health: int | str
                try:
                    health = daemon.health()
                except CacheError as exc:
                    health = type(exc).__name__
            seen = what_is_open(socket, timeout_s=2.0)
            out[str(rank)] = {"pid": self.host.pid(rank), "health": health,
                              **{k: seen[k] for k in ("state", "epoch", "attached", "error") if k in seen}}
        return out

    # -- the report ---------------------------------------------------------------------

    def report(self, ran_s: float, ready_s: float) -> dict[str, Any]:
        cfg, ranks = self.cfg, self.schedulers
        faults = self.injector.faults
        compared = compare(ranks, [f.as_dict(self.began) for f in faults], self.began, cfg.call_timeout_s)
        fallbacks = {str(r.rank): r.fallbacks for r in ranks}
        reattaches = {str(r.rank): r.attaches[1:] for r in ranks}
        spans = [s for r in ranks for s in r.spans_s]
        wrong = [f"rank {r.rank}: {w}" for r in ranks for w in r.wrong_decisions]
        lives = self.host.lives
        report: dict[str, Any] = {
            "topology": cfg.topology.describe(), "ranks": self.ranks, "seed": cfg.seed, "minutes": cfg.minutes,
            "agreement_timeout_s": cfg.agreement_timeout_s, "call_timeout_s": cfg.call_timeout_s,
            "hang_s": self.hang_s, "fault_every_s": cfg.fault_every_s, "ready_s": round(ready_s, 1),
            "ran_s": round(ran_s, 1), "iterations": self.iteration, "settled": self.settled,
            **compared,
            "steps_sent": sum(r.steps_ok + r.steps_failed for r in ranks),
            "faults": len(faults), "faults_by_kind": dict(Counter(f.kind for f in faults)),
            "faults_combined": sum(f.combined for f in faults),
            "faults_missed_actions": sum(len(f.missed) for f in faults),
            "hangs": len(self.hangs), "hang_list": self.hangs,
            "wrong_decisions": len(wrong), "wrong_decision_list": wrong[:10],
            "fallbacks": fallbacks, "reattaches": reattaches,
            "fallbacks_match": len({tuple(v) for v in fallbacks.values()}) == 1,
            "reattaches_match": len({tuple(v) for v in reattaches.values()}) == 1,
            "fallback_differences": differences(fallbacks), "reattach_differences": differences(reattaches),
            "per_rank": {str(r.rank): {"steps_ok": r.steps_ok, "steps_failed": r.steps_failed,
                                       "fallbacks": len(r.fallbacks), "reattaches": len(r.attaches[1:]),
                                       "attach_failures": r.attach_failures, "attach_skips": r.skips,
                                       "without_tiers_s": round(r.without_tiers_s(), 1)} for r in ranks},
            "without_tiers_s": {"total": round(sum(spans), 1), "max": round(max(spans, default=0.0), 1),
                                "mean": round(sum(spans) / len(spans), 2) if spans else 0.0,
                                "still_without_at_end": [r.rank for r in ranks if r.session is None]},
            "daemon_exits": {str(r): dict(Counter(str(x.code) for x in lives if x.rank == r))
                             for r in range(self.ranks)},
            "daemon_restarts": sum(x.back_s is not None for x in lives),
            "daemon_back_s_max": max((x.back_s for x in lives if x.back_s is not None), default=0.0),
            "armed_lives": [{"rank": x.rank, "armed": x.armed} for x in lives if x.armed],
            "harness_errors": self.harness_errors + self.injector.errors,
            "fault_list": with_episodes([f.as_dict(self.began) for f in faults], fallbacks, reattaches),
        }
        report["ok"] = (report["divergences"] == 0 and report["hangs"] == 0 and report["wrong_decisions"] == 0
                        and not report["harness_errors"])
        return report


def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the chaos bench; -> its report. The run dir (logs) is kept when it failed."""
    run_dir = cfg.run_dir or Path(tempfile.mkdtemp(prefix="cpchaos-"))
    report = ChaosRun(cfg, run_dir).execute()
    report["run_dir"] = str(run_dir)
    if report["ok"] and cfg.run_dir is None and not cfg.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
        report["run_dir"] = None
    return report


# -- the command line -------------------------------------------------------------------------


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"fault kinds are {', '.join(KINDS)}; got {text!r}")
    return kinds


def _add(group: Any, parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add `flag` unless the parser has it already (bench shares --seed,
    --minutes, --json with other benches)."""
    if flag not in parser._option_string_actions:
        group.add_argument(flag, **kwargs)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """chaos's flags (those another bench added already are shared)."""
    d = ChaosConfig()
    group = parser.add_argument_group("chaos")
    _add(group, parser, "--tp", type=int, default=d.tp, help="chaos: tensor-parallel size (one domain: --tp 8 --cp 8)")
    _add(group, parser, "--cp", type=int, default=d.cp, help="chaos: attention context-parallel size")
    _add(group, parser, "--minutes", type=float, default=d.minutes, help="chaos: how long faults are injected")
    _add(group, parser, "--seed", type=int, default=d.seed, help="chaos: seed of the steps and the faults")
    _add(group, parser, "--json", action="store_true", help="print one JSON object")
    group.add_argument("--chaos-agreement-timeout-s", type=float, default=d.agreement_timeout_s,
                       help="chaos: the daemons' agreement_timeout_s")
    group.add_argument("--chaos-call-timeout-s", type=float, default=d.call_timeout_s,
                       help=f"chaos: the schedulers' call deadline (above the agreement timeout + "
                       f"{DEADLINE_MARGIN_S:g} s)")
    group.add_argument("--chaos-fault-every-s", type=float, default=d.fault_every_s,
                       help="chaos: a fault every uniform(0.75, 1.25) x this many seconds after the last ended")
    group.add_argument("--chaos-kinds", type=_kinds, default=d.kinds, metavar="KIND,...",
                       help=f"chaos: the faults dealt (default: all of {', '.join(KINDS)})")
    group.add_argument("--chaos-settle-s", type=float, default=d.settle_s,
                       help="chaos: after the faults, longest wait for every rank to attach again")
    group.add_argument("--chaos-run-dir", help="chaos: where sockets, logs and pages go (kept)")


def config_of(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(tp=args.tp, cp=args.cp, minutes=args.minutes, seed=args.seed,
                       agreement_timeout_s=args.chaos_agreement_timeout_s, call_timeout_s=args.chaos_call_timeout_s,
                       fault_every_s=args.chaos_fault_every_s, kinds=tuple(args.chaos_kinds),
                       settle_s=args.chaos_settle_s,
                       run_dir=Path(args.chaos_run_dir) if args.chaos_run_dir else None)


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_of(args)
        check_deadline(cfg.call_timeout_s, cfg.agreement_timeout_s)
    except InvalidArgument as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    report = run_chaos(cfg)
    print(json.dumps(report) if args.json else text_report(report), flush=True)
    if not report["ok"]:
        print(f"chaos: FAILED (logs in {report['run_dir']})", file=sys.stderr)
    return 0 if report["ok"] else 1


__all__ = ["COMBINED", "KINDS", "ChaosConfig", "add_flags", "main", "run_chaos"]
