"""The README's settings table lists every setting the daemon takes."""

from pathlib import Path

from cpcache.config import SETTINGS


def test_every_setting_is_documented():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name in SETTINGS if f"| `{name}` |" not in readme]
    assert not missing, f"README's settings table lacks {missing}"


def _command(readme: str, program: str) -> list[str]:
    """The README's command line that runs `program`, continuations joined."""
    import shlex

    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if program in line)
    text = ""
    for line in lines[start:]:
        text += line.strip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(text)


def test_the_readmes_sglang_command_is_the_one_the_suite_runs():
    from cpcache.integrations.sglang import server_flags
    from cpcache.tools.sglang_cpu import servers
    from cpcache.tools.sglang_cpu.servers import CPCACHE_FLAGS

    assert servers.STORAGE_EXTRA_CONFIG == server_flags.STORAGE_EXTRA_CONFIG

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    argv = _command(readme, "python -m sglang.launch_server")
    assert argv[argv.index("python"):][:3] == ["python", "-m", "sglang.launch_server"]
    flags = argv[argv.index("sglang.launch_server") + 1:]
    pairs = {(flags[i], flags[i + 1] if i + 1 < len(flags) else "") for i in range(len(flags))}
    for i, flag in enumerate(CPCACHE_FLAGS):
        if flag.startswith("--"):
            value = CPCACHE_FLAGS[i + 1] if i + 1 < len(CPCACHE_FLAGS) and not CPCACHE_FLAGS[i + 1].startswith("--") \
                else None
            assert flag in flags, f"the README's SGLang command lacks {flag}"
            if value is not None:
                assert (flag, value) in pairs, f"the README gives {flag} another value than the suite ({value})"
