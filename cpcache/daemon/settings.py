"""Resolve a `DaemonConfig` from flags, then `CPCACHE_*` environment
variables, then a TOML file: flags win over the environment, the environment
over the file. The only place that reads the environment."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

import cpcache
from cpcache.config import SETTINGS, DaemonConfig
from cpcache.domain_file import convert_setting
from cpcache.errors import InvalidArgument

ENV_PREFIX = "CPCACHE_"


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpcached",
        description="cpcache daemon: one per rank. Settings come from flags, then "
        f"{ENV_PREFIX}<NAME> environment variables, then --config FILE (TOML).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {cpcache.__version__}")
    p.add_argument("--config", help="TOML file with settings by name")
    for name, f in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                           help=f.metadata["help"])
        else:
            # A fixed set of values is listed as choices (log levels in any case).
            p.add_argument(flag, dest=name, default=None, help=f"{f.metadata['help']} [{f.default!r}]",
                           choices=f.metadata.get("choices"), type=str.upper if name == "log_level" else str)
    return p


def resolve(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    environ = os.environ if environ is None else environ
    args = parser().parse_args(argv)
    values: dict[str, Any] = {}
    config_file = args.config or environ.get(ENV_PREFIX + "CONFIG")
    if config_file:
        try:
            with open(config_file, "rb") as fh:
                from_file = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"config file {config_file}: {exc}") from None
        unknown = sorted(set(from_file) - set(SETTINGS))
        if unknown:
            raise InvalidArgument(f"config file {config_file}: unknown settings {unknown}")
        values.update({k: convert_setting(k, v, config_file) for k, v in from_file.items()})
    for name in SETTINGS:
        if env_name(name) in environ:
            values[name] = convert_setting(name, environ[env_name(name)], env_name(name))
    for name in SETTINGS:
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = convert_setting(name, flag_value, "--" + name.replace("_", "-"))
    return DaemonConfig.from_settings(values)


def as_flags(config: DaemonConfig) -> list[str]:
    """The flags that reproduce `config` (used by the local launcher)."""
    flags = []
    for name, value in config.settings().items():
        if value == SETTINGS[name].default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags
