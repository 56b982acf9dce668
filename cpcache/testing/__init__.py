"""Kits that exercise and measure a deployment from outside, installed with
the package so the CLI and the test suites share them: the trace simulator
(sim/), the soaks, the fuzzer, a Mooncake master on loopback and the compose
driver; and, in a source checkout only (a wheel leaves it out:
docs/development.md, "The kits"), real SGLang servers on hosts without CUDA
with the CPU patches they need (sglang_cpu/).

Its rule (tests/unit/test_layering.py): testing drives daemons the way a user
does, through the launcher (`cpcache.daemon.launcher`) and the client, and
starts SGLang with the integration's own flags, so it imports the daemon, the
data plane's pools, the integrations, the client, the wire code and the
vocabulary; never the CLI (`cpcache.tools`, which imports testing lazily for
its `demo`, `fuzz` and `bench` commands).
"""
