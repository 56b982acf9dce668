"""The README's settings table lists every setting the daemon takes."""

from pathlib import Path

from cpcache.config import SETTINGS


def test_every_setting_is_documented():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name in SETTINGS if f"| `{name}` |" not in readme]
    assert not missing, f"README's settings table lacks {missing}"
