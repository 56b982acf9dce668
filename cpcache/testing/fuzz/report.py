"""What a fuzz run sent, what answered, and every violation of the checks,
with the request that caused it."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from cpcache.testing.fuzz.wire import ALLOWED, RPCS, CallOutcome, short


@dataclass
class Report:
    per_rpc: int
    seed: int
    sent: Counter = field(default_factory=Counter)
    raw_sent: Counter = field(default_factory=Counter)
    statuses: dict = field(default_factory=lambda: defaultdict(Counter))
    violations: list = field(default_factory=list)
    rounds: int = 0
    rejected_rounds: int = 0
    accepted_rounds: int = 0
    wall_s: float = 0.0

    def count(self, rpc: str, outcome: CallOutcome, raw: bool = False) -> None:
        self.sent[rpc] += 1
        if raw:
            self.raw_sent[rpc] += 1
        self.statuses[rpc][outcome.code] += 1

    def check_undecodable(self, rpc: str, outcome: CallOutcome, data: bytes) -> None:
        """A request whose bytes do not decode must be refused with a documented status."""
        if outcome.ok:
            self.violation("undecodable request accepted", rpc, "OK", data)
        elif outcome.code in ("UNKNOWN", "INTERNAL"):
            self.violation("undocumented status (undecodable bytes)", rpc, f"{outcome.code}: {short(outcome.message)}",
                           data)

    def violation(self, kind: str, rpc: str, detail: str, request: bytes | str | None = None) -> None:
        if len(self.violations) >= 500:
            return
        entry = dict(kind=kind, rpc=rpc, detail=detail[:1500])
        if isinstance(request, bytes):
            entry["request_hex"] = request[:2048].hex()
        elif request is not None:
            entry["request"] = request[:2048]
        self.violations.append(entry)

    def check_status(self, rpc: str, outcome: CallOutcome, data: bytes, deadline_ok: bool = False) -> None:
        """A violation unless `outcome` is a status `rpc` documents."""
        if outcome.code in ALLOWED[rpc]:
            return
        if deadline_ok and outcome.code == "DEADLINE_EXCEEDED":
            return
        self.violation("undocumented status", rpc, f"{outcome.code} ({outcome.reason}): "
                       f"{short(outcome.message)}", data)

    def as_dict(self) -> dict:
        return dict(
            seed=self.seed, per_rpc=self.per_rpc, wall_s=round(self.wall_s, 1),
            rounds=self.rounds, accepted_rounds=self.accepted_rounds, rejected_rounds=self.rejected_rounds,
            rpcs={rpc: dict(sent=self.sent[rpc], raw=self.raw_sent[rpc], statuses=dict(self.statuses[rpc]))
                  for rpc in RPCS},
            violations=self.violations,
        )


def print_report(report: Report) -> None:
    d = report.as_dict()
    print(f"cpcache fuzz: seed {d['seed']}, {d['per_rpc']} per RPC, {d['wall_s']} s, {d['rounds']} rounds "
          f"({d['accepted_rounds']} accepted, {d['rejected_rounds']} refused)")
    for rpc, row in d["rpcs"].items():
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(row["statuses"].items()))
        print(f"  {rpc:10} sent {row['sent']:6} (raw {row['raw']:5})  {statuses}")
    print(f"violations: {len(d['violations'])}")
    for v in d["violations"][:20]:
        print(f"  - {v['kind']} [{v['rpc']}]: {v['detail'][:400]}")
