"""What a soak counts (`cpcache bench soak`, cpcache/testing/soak.py), and
the line it prints while it runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from cpcache.client import Tally


@dataclass
class SoakReport:
    decisions: int = 0
    injected_rejections: int = 0
    divergences: int = 0
    hangs: int = 0
    wrong_bytes: int = 0  # loaded pages whose bytes differ from what was written, summed over ranks
    wrong_decisions: int = 0
    unexpected_errors: int = 0
    wall_s: float = 0.0
    steps: int = 0
    accepted_steps: int = 0
    cancelled_calls: int = 0
    cancelled_mid_round: int = 0  # of which: cancelled while the daemon held the step in its round
    retried_steps: int = 0
    verified_pages: int = 0
    cache: Tally = field(default_factory=Tally)  # the cache operations of the steps taken, and their outcomes
    votes_per_step: float = 0.0  # mean, over the steps sent
    max_votes_per_step: int = 0
    decisions_per_s: float = 0.0
    steps_per_s: float = 0.0
    first_errors: list = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.first_errors) < 10:
            self.first_errors.append(what)

    @property
    def ok(self) -> bool:
        return not (self.divergences or self.hangs or self.wrong_bytes or self.wrong_decisions
                    or self.unexpected_errors)


def print_progress(t: SoakReport, elapsed: float) -> None:
    c = t.cache
    print(f"  {elapsed:6.0f}s  steps {t.steps}  decisions {t.decisions}  rejections {t.injected_rejections}  "
          f"cancelled {t.cancelled_calls}  writes {c.write_acks}/{c.write_failures}  loads {c.load_acks}/"
          f"{c.load_failures}  divergences {t.divergences}  wrong bytes {t.wrong_bytes}", file=sys.stderr, flush=True)
