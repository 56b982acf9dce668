"""The daemon's typed errors, read back from a failed call: the class its
`google.rpc.ErrorInfo` names (with its metadata), else the class of its
status code; and the same from a step's error carried as data (`Outcome`)."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from cpcache import errors
from cpcache.v1 import daemon_pb2 as pb

# Without an ErrorInfo, a status code names the base class of its kind (the
# subclasses are told apart by their reason only).
_BY_CODE: dict[grpc.StatusCode, type[errors.CacheError]] = {
    grpc.StatusCode[kind.status]: kind for kind in errors.FAMILY if kind.__bases__ == (errors.CacheError,)
}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = errors.Unavailable
_DETAILS_KEY = "grpc-status-details-bin"


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The cpcache `ErrorInfo` in a failed call's status details, if any.
    Read from the trailing metadata, which blocking and aio errors both carry."""
    for key, value in getattr(exc, "trailing_metadata", lambda: None)() or ():
        if key != _DETAILS_KEY:
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:  # a malformed status: fall back to the code
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == errors.DOMAIN:
                return info
    return None


def error_from(exc: grpc.RpcError) -> errors.CacheError:
    """The typed error a failed call stands for: the class its ErrorInfo's
    reason names (built from the ErrorInfo's metadata), else the class of its
    status code. The message is `CODE: details`."""
    info = error_info(exc)
    if info is None:
        return typed(exc.code().name, "", exc.details() or "", {})
    return typed(exc.code().name, info.reason, exc.details() or "", dict(info.metadata))


def typed(status: str, reason: str, message: str, metadata: dict[str, str]) -> errors.CacheError:
    """The typed error named by a status code's name and a reason."""
    code = grpc.StatusCode[status] if status in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    kind = errors.BY_REASON.get(reason)
    text = f"{code.name}: {message}"
    if kind is not None and kind.status == code.name:
        try:
            return kind.from_metadata(text, metadata)
        except (ValueError, TypeError):  # metadata this client cannot read: keep the kind's family
            pass
    return _BY_CODE.get(code, errors.CacheError)(text)


def step_error_from(error: pb.StepError) -> errors.CacheError:
    return typed(error.status, error.reason, error.message, dict(error.metadata))
