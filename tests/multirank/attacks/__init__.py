"""Attacks on restarts and sessions, kept as regressions:
one rank re-attaching with another geometry, a cancelled Attach retried, a
request id prefetched twice."""
