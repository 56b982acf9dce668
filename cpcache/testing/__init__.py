"""Kits that exercise and measure a deployment from outside, installed with
the package so the CLI and the test suites share them: the trace simulator
(sim/), the soaks, the fuzzer, real SGLang servers on hosts without CUDA
(sglang_cpu/), a Mooncake master on loopback and the compose driver.

Its rule (tests/test_layering.py): testing drives daemons the way a user
does, through the launcher (`cpcache.daemon.launcher`) and the client, so it
imports the daemon, the data plane's pools, the client, the wire code and the
vocabulary, never the CLI (`cpcache.tools`, which imports testing lazily for
its `demo`, `fuzz` and `bench` commands).
"""
