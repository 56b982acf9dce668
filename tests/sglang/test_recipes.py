"""docs/sglang.md's recipes run as the page prints them (tests/sglang/recipes.py
takes them from the page), on this CPU host with the page's CPU host lines.

- colocated and prefill/decode apart, whole: every process the recipe
  starts (mooncake_master, `cpcache launch`, the servers, the router), two
  requests answered (the second finding the first's prefix), every daemon
  attached to its server;
- context parallelism, attention DP and replicas on one store, for less:
  the daemons (and the store) the recipe starts, each serving with the
  domain its sizes give, and every server line of every recipe parsed by
  SGLang's own argument parser, its sizes the daemons'. Their servers run
  in test_cp.py, test_dp_attention.py and test_replicas_one_store.py;
- the launch line of the README before 0.2.0 (class `DaemonStorage`) still
  starts a server over the colocated recipe's daemons, serves, and says
  the name is deprecated in its log.

Substituted, and nothing else: the page's models (the suite's tiny ones),
its ports (free ones), `/path/to/cpcache` (this checkout), and the SGLang
environment first on PATH; every server gets `--skip-tokenizer-init` (a
tiny model has no tokenizer; requests send token ids) and `--sleep-on-idle`
(an idle server would spin a core of two under the servers still starting).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON, Reply, Server, sglang_interpreter
from tests.sglang.recipes import MODELS, Command, Run, Substitutions, commands, on_cpu_host, recipes
from tests.sglang.stacks import References

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

TEST_FLAGS = " --skip-tokenizer-init --sleep-on-idle"
# The README's launch line before 0.2.0 (README.md at e7e0efc^), as it was printed: the storage class's old name.
README_BEFORE_0_2_0 = """\
cpcache launch --tp 2 --run-dir ./cpc-run --config daemons.toml &
CPCACHE_SGLANG_CONFIG=sglang-cpcache.json python -m sglang.launch_server \\
  --model-path meta-llama/Llama-3.1-8B-Instruct --tp 2 --page-size 16 \\
  --radix-cache-backend cpcache --enable-hierarchical-cache --hicache-ratio 1 \\
  --hicache-storage-backend dynamic \\
  --hicache-storage-backend-extra-config '{"backend_name": "cpcache", "module_path": \
"cpcache.integrations.sglang.storage", "class_name": "DaemonStorage"}'"""
DEPRECATED = "storage.DaemonStorage is deprecated; it is now cpcache.integrations.sglang.storage.CpcacheStore"
PROMPT = list(range(1, 70))  # four pages and a part


@pytest.fixture(scope="module")
def page() -> dict[str, str]:
    return recipes()


def substitutions(references: References, page_block: str, port: dict[int, int] | None = None) -> Substitutions:
    models = {name: references.model(family) for name, family in MODELS.items() if name in page_block}
    return Substitutions(models, port or {}, TEST_FLAGS)


def generate(port: int, ids: list[int]) -> Reply:
    return Server("client", Path(), Path(), [], port=port).generate(ids)


def sizes(launch: str) -> dict[str, int]:
    """`cpcache launch`'s sizes, as its line gives them."""
    words = shlex.split(launch)
    return {size: int(words[words.index(f"--{size}") + 1]) if f"--{size}" in words else 1
            for size in ("tp", "cp", "dp")}


def attached_daemons(run: Run, run_dir: str, count: int) -> list:
    """Every daemon's status under `run_dir`; there are `count`."""
    statuses = []
    for path in run.sockets(run_dir):
        with Client(str(path), timeout_s=30) as daemon:
            statuses.append(daemon.status())
    assert len(statuses) == count, f"{len(statuses)} daemons under {run_dir}, not {count}"
    return statuses


def served_twice(port: int) -> tuple[Reply, Reply]:
    """Two requests, the second extending the first: sane replies, and the
    second finds the first's pages."""
    first = generate(port, PROMPT)
    second = generate(port, PROMPT + [7, 8, 9])
    for reply in (first, second):
        assert len(reply.output_ids) == 4 and reply.finish == "length", reply
        assert all(0 <= token < 512 for token in reply.output_ids), reply
    assert second.cached >= 64, f"the second request found none of the first's pages: {second}"
    return first, second


def test_the_page_marks_each_recipe(page: dict[str, str]):
    assert set(page) == {"cpu-host", "colocated", "cp", "dp", "pd", "replicas"}, sorted(page)
    for name, block in page.items():
        if name == "cpu-host":
            continue
        steps = commands(block)
        servers = [c for c in steps if c.kind == "sglang.launch_server"]
        assert servers and all(c.background for c in servers), name
        assert [c for c in steps if c.kind == "cpcache launch"], f"{name} starts no daemons"
        needs_store = any('"mooncake"' in c.text for c in steps)
        assert needs_store == any(c.kind == "mooncake_master" for c in steps), f"{name}: a store and no master"


@pytest.fixture(scope="module")
def parsed(page: dict[str, str]) -> dict[str, list[dict]]:
    """Every server line of every recipe (as on a CPU host), through SGLang's
    own argument parser in one process: -> per recipe, each server's sizes."""
    argvs = {}
    for name, block in page.items():
        if name == "cpu-host":
            continue
        lines = [on_cpu_host(c).text + TEST_FLAGS for c in commands(block) if c.kind == "sglang.launch_server"]
        # The words the shell gives the server: variables expanded as the CPU host's lines set them.
        script = "\n".join([*(c.text for c in commands(page["cpu-host"])),
                            *(f"set -- {line}; printf '%s\\0' \"$@\"; printf '\\n'" for line in lines)])
        words = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=60).stdout
        argvs[name] = [w.split("\0")[:-1] for w in words.splitlines()]
        argvs[name] = [argv[argv.index("sglang.launch_server") + 1:] for argv in argvs[name]]
    parse = ("import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
             "parser = argparse.ArgumentParser(); ServerArgs.add_cli_args(parser)\n"
             "out = {name: [vars(parser.parse_args(argv)) for argv in argvs]\n"
             "       for name, argvs in json.load(sys.stdin).items()}\n"
             "print(json.dumps({name: [{k: a[k] for k in ('tp_size', 'attn_cp_size', 'dp_size', "
             "'enable_dp_attention', 'disaggregation_mode', 'device')} for a in parsed] "
             "for name, parsed in out.items()}))")
    done = subprocess.run([sglang_interpreter(), "-c", parse], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["cp", "dp", "replicas"])
def test_a_recipe_starts_its_daemons_with_its_servers_sizes(name: str, page: dict[str, str], parsed: dict,
                                                            tmp_path: Path):
    block = page[name]
    launches = [c for c in commands(block) if c.kind == "cpcache launch"]
    servers = parsed[name]
    assert len(launches) == len(servers), f"{name}: {len(launches)} launches for {len(servers)} servers"
    for launch, server in zip(launches, servers):
        want = sizes(launch.text)
        assert server["device"] == "cpu", server
        got = {"tp": server["tp_size"], "cp": server["attn_cp_size"], "dp": server["dp_size"]}
        assert got == want, f"{name}: the server's sizes {got}, its daemons' {want}"
        assert (want["dp"] > 1) == bool(server["enable_dp_attention"]), server
    # Only the store and the daemons: what the recipe starts but its servers.
    without_servers = "\n".join(c.text + (" &" if c.background else "") for c in commands(block)
                                if c.kind != "sglang.launch_server")
    run = Run(tmp_path, without_servers, page["cpu-host"], Substitutions({}, {}, TEST_FLAGS))
    try:
        run.start().wait_ready(timeout_s=120)
        for launch in launches:
            run_dir = shlex.split(launch.text)[shlex.split(launch.text).index("--run-dir") + 1]
            want = sizes(launch.text)
            statuses = attached_daemons(run, run_dir, want["tp"])
            per_domain = want["tp"] // want["dp"]
            assert [s.state for s in statuses] == ["serving"] * want["tp"], statuses
            assert [list(s.domain_ranks) for s in statuses] == \
                [list(range(r // per_domain * per_domain, (r // per_domain + 1) * per_domain))
                 for r in range(want["tp"])], statuses
            assert not any(s.attached for s in statuses)
    finally:
        run.stop()


def test_prefill_and_decode_apart_recipe_serves_through_its_router(page: dict[str, str], references: References,
                                                                   tmp_path: Path):
    block = page["pd"]
    subs = substitutions(references, block)
    run = Run(tmp_path, block, page["cpu-host"], subs)
    try:
        run.start().wait_ready()
        assert [c.kind for c, _ in run.processes] == \
            ["mooncake_master", "cpcache launch", "sglang.launch_server", "sglang.launch_server", "sglang_router"]
        served_twice(subs.port(8000))
        assert all(s.attached for s in attached_daemons(run, "cpc-run", 2))
        _, decode = run.of_kind("sglang.launch_server")
        opened = decode.wait_lines("cpcache: store", 1, timeout_s=120)
        assert re.search(r"tenant \w+", opened[0]), opened
    finally:
        run.stop()


@pytest.fixture(scope="module")
def colocated(page: dict[str, str], references: References,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Run, Substitutions]]:
    """The colocated recipe, running: its daemons serve both tests below (the
    last servers of the module: a module's fixture ends with the module)."""
    block = page["colocated"]
    subs = substitutions(references, block)
    run = Run(tmp_path_factory.mktemp("colocated"), block, page["cpu-host"], subs)
    try:
        yield run.start().wait_ready(), subs
    finally:
        run.stop()


def test_colocated_recipe_serves_over_its_daemons(colocated: tuple[Run, Substitutions]):
    run, subs = colocated
    served_twice(subs.port(30000))
    assert all(s.attached for s in attached_daemons(run, "cpc-run", 2))


def test_the_readme_line_before_0_2_0_still_starts_a_server_and_says_the_name_is_deprecated(
        page: dict[str, str], colocated: tuple[Run, Substitutions]):
    """Its `cpcache launch` is the recipe's; its server, the recipe's but for
    the storage class: started over the recipe's daemons in the recipe's
    place."""
    run, subs = colocated
    old = commands(README_BEFORE_0_2_0)
    assert old[0] in commands(page["colocated"]), "the README's daemons before 0.2.0 are not the recipe's"
    for server in run.of_kind("sglang.launch_server"):
        server.stop()
    # It named no port: SGLang's default, a free one here.
    again = Run(run.work, f"{old[1].text} --port {subs.port(30000)} &", page["cpu-host"], subs)
    again.preamble = run.preamble
    run.processes += again.start().processes
    again.wait_ready()
    reply = generate(subs.port(30000), PROMPT)
    assert len(reply.output_ids) == 4 and reply.finish == "length", reply
    (server,) = again.of_kind("sglang.launch_server")
    assert server.lines_with(DEPRECATED), f"no deprecation warning in the server's log:\n{server.tail()}"
    assert all(s.attached for s in attached_daemons(run, "cpc-run", 2))


def test_recipe_commands_split_as_a_shell_runs_them():
    block = "cat > a.toml <<EOF\nx = 1\nEOF\nexport A=1\nrun one \\\n  --flag two &\n# a comment\n"
    assert commands(block) == [Command("cat > a.toml <<EOF\nx = 1\nEOF", False), Command("export A=1", False),
                               Command("run one --flag two", True)]
