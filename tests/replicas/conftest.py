"""Hypothesis settings for the replica harness. CPCACHE_REPLICA_EXAMPLES=N
selects a long run of N examples per property (e.g. 5000); the default run
takes well under a minute. Read here only."""

import os

from hypothesis import HealthCheck, settings

_long = int(os.environ.get("CPCACHE_REPLICA_EXAMPLES", "0") or 0)
LONG = bool(_long)
REPLICA_SETTINGS = settings(
    max_examples=_long or 200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
