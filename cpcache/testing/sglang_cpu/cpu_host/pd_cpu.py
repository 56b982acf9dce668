"""SGLang 0.5.23's prefill/decode disaggregation (Mooncake's transfer engine
over TCP on loopback) on this CPU-only host. Imported by sitecustomize.py
only when CPCACHE_TEST_PD_CPU=1; for the SGLang suite on such hosts only
(tests/sglang/test_pd.py, through cpcache/testing/sglang_cpu/pd.py).

The prefill scheduler's send path (sglang/srt/disaggregation/prefill.py)
hands the transfer worker CUDA events to wait on, which a torch without CUDA
cannot make ("Tried to instantiate dummy base class Event"), and pinned
memory, which it cannot allocate ("pin_memory=True requires a CUDA or other
accelerator backend"):

- `_send_kv_chunk`: with Mooncake (`MooncakeKVSender.
  supports_host_tensor_indices`), the request's page indices are copied
  device to host into a pinned tensor, without blocking, and a CUDA event
  recorded behind the copy goes with them: the worker waits on it, not the
  scheduler;
- `maybe_send_cached_prefix_chunk` (SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX,
  on by default): under the overlap scheduler, a request whose prefix is
  cached on the device sends that prefix's KV before its own forward, with
  a CUDA event recorded on the forward stream behind the previous forward,
  which may still be writing those pages: the worker waits on it before it
  reads them.

Here the "device" is host memory and the forward stream is torch.cpu's:
every forward and every copy has ended on the scheduler thread before the
next line runs, so the CPU's events (torch.cpu.Event: record and
synchronize do nothing) are exact, and a plain tensor holds the indices as
well as a pinned one would. The patch gives prefill.py a `torch` whose
`cuda.Event` and `cuda.current_stream` are the CPU's and whose `empty`
ignores `pin_memory`: the send path runs as on a GPU (the transfer worker
takes the host tensor and its event, waits, converts it), rather than the
paths SGLang would take without them (the numpy page indices of the other
transfer backends; no early send of the cached prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch


class _TorchOnCpu(ModuleType):
    """torch, with CUDA's events and current stream answered by the CPU's,
    and `empty(..., pin_memory=True)` by an ordinary tensor."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = SimpleNamespace(Event=torch.cpu.Event, current_stream=torch.cpu.current_stream)

    @staticmethod
    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_prefill(module: ModuleType) -> None:
    module.torch = _TorchOnCpu()  # type: ignore[attr-defined]


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.disaggregation.prefill": _patch_prefill,
}
