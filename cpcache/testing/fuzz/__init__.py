"""`cpcache fuzz`: hostile requests against live daemons.

Starts a real two-rank domain (`LocalDomain`, file storage, a small host
pool), attaches a shared-memory device pool on each rank, and sends every
CacheDaemon RPC hostile requests generated from one seed: messages built
field by field (ids near and above 2**63, zero, duplicates, empty and huge
page lists, wrong hash lengths, device pages out of range, NaN/inf/negative
timeouts, unknown enum values, absurd geometry, odd pool paths) and raw
malformed bytes sent through an untyped channel method.

Steps (a scheduler iteration's mix of fields, or one purpose alone: only
prefetches and polls, only revokes, nothing but the step number) go to
every rank with the same step number, strictly increasing (the same
hostile request everywhere, a hostile request on one rank and a valid one
on the other, two different hostile ones, identical raw bytes);
out-of-range, stale and retried step numbers go to one rank only. Local RPCs (Attach, WaitLoads, Match, Stats,
Status) go to one rank, 32 at a time, while the rounds run.

Checked: only documented statuses answer (never UNKNOWN or INTERNAL;
UNAVAILABLE only for WaitLoads); a step is accepted everywhere with
byte-identical replies or refused everywhere (the refusing rank with its own
status, the others REJECTED_BY_PEER, or DIVERGENCE everywhere); the cache
digest is the same on every rank after every round and unchanged by a
refused one; the daemons still serve at the end and a final valid step is
answered alike. Every pool path sent lies inside the fuzz's own run dir.

The modules: `wire` (the RPCs, the documented statuses, one rank's untyped
channel), `generate` (hostile requests from one seed), `decisions` (the
rounds and their checks), `session` (one run, its local RPCs, `main`),
`report` (what was sent, what answered, the violations).
"""

from cpcache.testing.fuzz.report import Report
from cpcache.testing.fuzz.session import fuzz, main
from cpcache.testing.fuzz.wire import DOCUMENTED, GEOMETRY, RPCS, SERVICE

__all__ = ["DOCUMENTED", "GEOMETRY", "RPCS", "SERVICE", "Report", "fuzz", "main"]
