"""What a built wheel carries: the product and the kits operators run
(the replay simulator, soaks, fuzzer, compose driver), never the CPU patches
of SGLang that the project's own tests load into SGLang's processes."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cpcache

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_wheel_leaves_the_sglang_cpu_patches_out(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "cpcache", source / "cpcache", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, timeout=280)
    (wheel,) = (tmp_path / "dist").glob("cpcache-*.whl")
    assert wheel.name.startswith(f"cpcache-{cpcache.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cpcache/daemon/main.py" in names and "cpcache/testing/sim/replay.py" in names
    assert "cpcache/integrations/sglang/__init__.py" in names
    patches = [n for n in names if "sglang_cpu" in n or n.endswith("sitecustomize.py")]
    assert patches == []


BLOCK_SGLANG_CPU = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("cpcache.testing.sglang_cpu"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
from cpcache.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(60)
def test_without_the_sglang_cpu_kits_the_cli_serves_and_says_what_is_missing():
    def cli(*args):
        return subprocess.run([sys.executable, "-c", BLOCK_SGLANG_CPU, *args], capture_output=True, text=True,
                              timeout=50)

    assert cli("--help").returncode == 0
    assert cli("bench", "--help").returncode == 0
    serving = cli("bench", "serving")
    assert serving.returncode == 2 and "source checkout" in serving.stderr
