"""Which of SGLang's model modules a server needs (opt-in: the test kit's
servers set CPCACHE_TEST_MODEL_ARCHS to their model's `architectures`).

SGLang's model registry imports each of its 200-odd model modules in every
scheduler, about 2 s of each server's start on a 2-core host, for the one
model it serves. SGLANG_DISABLED_MODEL_ARCHS names the modules it skips:
here every one that defines none of the model's architecture classes,
SGLang's Transformers fallback kept. An architecture defined nowhere (an
alias, a class made otherwise) skips nothing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

KEPT = ("transformers",)  # SGLang's fallback for an architecture it has no module of


def disabled(models: Path, architectures: list[str]) -> list[str] | None:
    """The modules of `models` to skip for `architectures` (None: skip none)."""
    modules = sorted(p for p in models.glob("*.py") if not p.stem.startswith("_"))
    keep, found = set(KEPT), set()
    for path in modules:
        text = path.read_text(errors="replace")
        here = {arch for arch in architectures if f"class {arch}(" in text}
        if here:
            keep.add(path.stem)
            found |= here
    if not architectures or found != set(architectures):
        return None
    return [p.stem for p in modules if p.stem not in keep]


def install(architectures: str) -> None:
    """Set SGLANG_DISABLED_MODEL_ARCHS for `architectures` (comma-separated),
    the installed SGLang's modules read where it lies, importing none of it."""
    spec = importlib.util.find_spec("sglang")  # a top-level package: located, not imported
    if spec is None or not spec.submodule_search_locations:
        return
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    names = disabled(models, [a.strip() for a in architectures.split(",") if a.strip()])
    if names is not None:
        os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(names)
