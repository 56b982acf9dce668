"""A domain's settings file: the TOML of cpcached's settings by name that
`cpcache launch --config` reads for every rank (with `[rank.N]` tables of a
single rank's fault injection), and that a process writing the domain's
store directly reads for the store (`domain_config`). Reads the file it is
given, never the environment."""

from __future__ import annotations

import tomllib
from typing import Any

from cpcache.config import FAULT_SETTINGS, SETTINGS, DaemonConfig
from cpcache.errors import InvalidArgument


def convert_setting(name: str, raw: Any, source: str) -> Any:
    """A setting's value as its type, from a flag's, a variable's or a file's text."""
    kind: type = type(SETTINGS[name].default)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        raise InvalidArgument(f"setting {name} from {source}: {text!r} is not a valid {kind.__name__}") from None


# Set by `cpcache launch` per rank, never in a domain's file.
LAUNCHER_OWNED = {"rank", "tp", "pp", "dp", "cp", "rendezvous", "deployment", "socket"}


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"{path}: {exc}") from None


def domain_file_settings(path: str | None) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Every rank's settings, and settings for single ranks (`[rank.N]`
    tables, e.g. to slow one rank's copies), from a domain's TOML file of
    cpcached's settings (names as in `cpcached --help`), as `cpcache launch
    --config` reads it; the launcher's own (rank, sizes, rendezvous, socket)
    are not settable there."""
    if not path:
        return {}, {}
    settings = _load(path)
    per_rank = settings.pop("rank") if isinstance(settings.get("rank"), dict) else {}
    unknown = sorted(set(settings) - (set(SETTINGS) - LAUNCHER_OWNED))
    if unknown:
        raise InvalidArgument(f"{path}: unknown or launcher-owned settings {', '.join(unknown)}")
    if not all(r.isdigit() and str(int(r)) == r for r in per_rank):
        raise InvalidArgument(f"{path}: [rank.N] tables need a rank number, got {sorted(per_rank)}")
    for rank, table in per_rank.items():
        # What a domain must hold alike (pools, storage, policies) is not a
        # rank's own: only fault injection may differ between ranks.
        own_only = sorted(set(table) - set(FAULT_SETTINGS)) if isinstance(table, dict) else ["(not a table)"]
        if own_only:
            raise InvalidArgument(f"{path}: [rank.{rank}] may set only fault_* settings, not {', '.join(own_only)}")
    return settings, {int(r): t for r, t in per_rank.items()}


def domain_config(path: str) -> DaemonConfig:
    """The settings every rank of a domain shares (storage, sharding), from
    its `cpcache launch --config` file or from one daemon's own `cpcached
    --config` file (its rank's settings are left out): what a process that
    writes the domain's store directly needs."""
    raw = _load(path)
    settings = {k: v for k, v in raw.items() if k in SETTINGS and k not in LAUNCHER_OWNED}
    unknown = sorted(set(raw) - set(SETTINGS) - {"rank"})
    if unknown:
        raise InvalidArgument(f"{path}: unknown settings {', '.join(unknown)}")
    return DaemonConfig.from_settings({**{k: convert_setting(k, v, path) for k, v in settings.items()}, "rank": 0})
