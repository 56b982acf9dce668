"""The shape of a model's KV cache, as attached by the inference process.

A page holds `page_size` tokens of every layer. MHA keeps K and V (two
components of `heads x head_dim`); MLA keeps one latent component (heads = 1,
head_dim = kv_lora_rank + rope dim). A `Region` is where one layer of an
attached device pool lies (the daemon's checks: `dataplane/regions.py`).

Some pools keep more than the KV for each page: DeepSeek V3.2's indexer
keeps its own keys and scales per page and layer, and a page restored
without them would be attended with another prefix's index. Such a part is
a `PagePart`, declared in the geometry beside the KV (`beside`), so a page
is always moved, stored and checked whole: every part or none. Each part is
a geometry of its own (`parts`), so the movers copy it as they copy the KV.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any

import torch

from cpcache.errors import InvalidArgument
from cpcache.hashing import hash62

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
KV_KINDS = ("mha", "mla")
PART_KIND = "part"  # a part beside the KV: one component of `rows_per_page` rows of `width` elements per page
MAX_PAGE_BYTES = 1 << 30
MAX_PARTS = 8  # parts beside the KV (DSA has one): a bound on what one attach may ask to validate
PART_NAME = re.compile(r"[a-z0-9_]{1,32}")
PART_ALIGN = 64  # bytes: where each part's block starts in a pool that holds several, on every tier


def check_part_count(count: int) -> None:
    """Refuse more parts beside the KV than MAX_PARTS (a decoder checks before building them)."""
    if count > MAX_PARTS:
        raise InvalidArgument(f"geometry: {count} parts beside the KV; at most {MAX_PARTS}")


@dataclass(frozen=True)
class PagePart:
    """A part of every page kept beside its KV, per layer: `rows_per_page`
    rows of `width` elements of `dtype` (DeepSeek V3.2's indexer: one row of
    page_size x (index_head_dim + scale bytes) uint8 per page)."""

    name: str
    rows_per_page: int
    width: int
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not PART_NAME.fullmatch(self.name) or self.name == "kv":
            raise InvalidArgument(f"geometry: a part's name is 1 to 32 of a-z, 0-9 and _, and not 'kv': "
                                  f"got {str(self.name)[:40]!r}")
        for name in ("rows_per_page", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"geometry: part {self.name!r}: {name} must be a positive integer, "
                                      f"got {value!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"geometry: part {self.name!r}: dtype must be one of {', '.join(DTYPES)}, "
                                  f"got {str(self.dtype)[:40]!r}")

    def key(self) -> tuple[str, int, int, str]:
        """What identifies the part (in fingerprints: not the class's repr)."""
        return (self.name, self.rows_per_page, self.width, self.dtype)


@dataclass(frozen=True)
class KVGeometry:
    # Sizes are computed once (cached_property writes to the instance dict,
    # which a frozen dataclass allows): they sit on every page's hot path.
    layers: int
    kv_kind: str  # "mha" (K and V) or "mla" (one latent)
    heads: int
    head_dim: int
    dtype: str
    page_size: int  # tokens per page
    beside: tuple[PagePart, ...] = ()  # the parts of a page kept beside its KV, in stored order

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"geometry: {name} must be a positive integer, got {value!r}")
        if self.kv_kind not in (*KV_KINDS, PART_KIND):
            raise InvalidArgument(f"geometry: kv_kind must be one of {', '.join(KV_KINDS)}, got {self.kv_kind!r}")
        if self.kv_kind != "mha" and self.heads != 1:
            raise InvalidArgument(f"geometry: MLA keeps one latent head, got heads={self.heads}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"geometry: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.beside, tuple):  # a list would hash apart, and fingerprint apart
            object.__setattr__(self, "beside", tuple(self.beside))
        check_part_count(len(self.beside))
        if any(not isinstance(part, PagePart) for part in self.beside):
            raise InvalidArgument("geometry: each part beside the KV must be a PagePart")
        names = [part.name for part in self.beside]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"geometry: part names must be distinct: {names}")
        if self.beside and self.kv_kind == PART_KIND:
            raise InvalidArgument("geometry: a part has no parts beside it")
        _ = self.parts  # builds each part's geometry, which checks it
        if self.page_bytes > MAX_PAGE_BYTES:
            raise InvalidArgument(f"geometry: a page of {self.page_bytes} bytes exceeds {MAX_PAGE_BYTES}")

    @functools.cached_property
    def parts(self) -> tuple[KVGeometry, ...]:
        """The page's parts, each a geometry of one part: the KV, then each
        part beside it (a part's "page" is its `rows_per_page` rows)."""
        if not self.beside:
            return (self,)
        kv = dataclasses.replace(self, beside=())
        parts = []
        for part in self.beside:
            try:
                parts.append(KVGeometry(layers=self.layers, kv_kind=PART_KIND, heads=1, head_dim=part.width,
                                        dtype=part.dtype, page_size=part.rows_per_page))
            except InvalidArgument as exc:
                raise InvalidArgument(f"geometry: part {part.name!r}: {str(exc).removeprefix('geometry: ')}") from None
        return (kv, *parts)

    @functools.cached_property
    def planes(self) -> tuple[tuple[KVGeometry, int], ...]:
        """(part, layer) of each region of a device pool, in region order:
        every layer of the KV, then every layer of each part beside it."""
        return tuple((part, layer) for part in self.parts for layer in range(self.layers))

    @property
    def part_names(self) -> tuple[str, ...]:
        return ("kv", *(part.name for part in self.beside))

    @property
    def components(self) -> int:
        return 2 if self.kv_kind == "mha" else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @functools.cached_property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of the KV per token (the parts beside it are per page)."""
        return self.layers * self.components * self.heads * self.head_dim * self.element_bytes

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of a whole page: its KV and every part beside it."""
        return self.token_bytes * self.page_size + sum(part.page_bytes for part in self.parts[1:])

    def pool_shape(self, pages: int) -> tuple[int, ...]:
        """The device pool's shape: [layers, components, tokens, heads, head_dim]."""
        return (self.layers, self.components, pages * self.page_size, self.heads, self.head_dim)

    def fingerprint(self) -> int:
        """Identifies this geometry in stored page headers (and in keys: a
        page with other parts is another page). A geometry without parts
        beside its KV has the fingerprint it had before parts existed."""
        fields: list[object] = [getattr(self, f) for f in self.__dataclass_fields__ if f != "beside"]
        if self.beside:
            fields.append(tuple(part.key() for part in self.beside))
        return hash62(repr(tuple(fields)).encode())


@dataclass(frozen=True)
class Region:
    """One layer of a device pool, a [components, rows, heads, head_dim]
    view: `offset` in bytes into its memory, `strides` in elements
    (component, row, head, head_dim); `cuda_ipc` names the CUDA storage
    holding it where each layer is shared on its own (the fields of
    `UntypedStorage._share_cuda_()`)."""

    offset: int
    strides: tuple[int, ...]
    cuda_ipc: dict[str, Any] | None = None

    def key(self) -> tuple:
        """A hashable form (what tells one attach's pool from another)."""
        ipc = tuple(sorted(self.cuda_ipc.items())) if self.cuda_ipc is not None else ()
        return (self.offset, self.strides, ipc)
