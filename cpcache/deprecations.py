"""Names an operator typed keep working after they are renamed or retired.

A class named in a server's flags, a key of a settings file: each old name
still does what it did, with a `DeprecationWarning` that says what to type
instead, logged too (a server does not show Python's `DeprecationWarning`s
by default). CHANGELOG.md lists each under "Deprecated" in the release
that retired it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)


def deprecated(message: str, stacklevel: int = 2) -> None:
    """Warn (and log) that an old name was used; `stacklevel` as for
    `warnings.warn`, counted from the caller of this function."""
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
    log.warning(message)


def renamed_attributes(module: str, namespace: Mapping[str, Any], renamed: Mapping[str, str],
                       hint: str = "") -> Callable[[str], Any]:
    """A module-level `__getattr__` for `module` under which each old name of
    `renamed` (old -> new) resolves to the new one in `namespace` (the
    module's `globals()`), with a warning. It runs only for names the module
    does not hold, so `getattr(module, "Old")` (a dynamic loader's) warns
    and `from module import New` does not."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        deprecated(f"cpcache: {module}.{name} is deprecated; it is now {module}.{new}{hint.format(new=new)}")
        return namespace[new]

    return __getattr__


def retired_keys(source: str, raw: dict[str, Any], retired: Mapping[str, str]) -> dict[str, Any]:
    """`raw` (a settings file's keys) without the retired ones (key -> why it
    is ignored now), each found named in a warning."""
    for key in sorted(set(raw) & set(retired)):
        deprecated(f"cpcache: {source}: setting {key} is deprecated and ignored: {retired[key]}", stacklevel=3)
    return {k: v for k, v in raw.items() if k not in retired}
