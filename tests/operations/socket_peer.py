"""A scheduler's first reach for its daemon, run as another user by
tests/operations/test_socket_group.py: connect to the gRPC socket and to
`<socket>.pools`, ask Health and Status, take the daemon's identity, and
try to write in the socket's directory. Prints one JSON object: each step's
outcome ("ok", or the error), the pid of the identity's pidfd."""

import errno
import json
import os
import socket
import sys


def connect(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        try:
            sock.connect(path)
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, repr(exc))
    return "ok"


def main() -> None:
    path = sys.argv[1]
    out: dict[str, object] = {"uid": os.getuid(), "groups": sorted(os.getgroups())}
    out["grpc_connect"] = connect(path)
    out["pools_connect"] = connect(path + ".pools")
    try:
        fd = os.open(os.path.join(os.path.dirname(path), f".peer-{os.getpid()}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                     0o600)
        os.close(fd)
        out["write_dir"] = "ok"
    except OSError as exc:
        out["write_dir"] = errno.errorcode.get(exc.errno or 0, repr(exc))

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cpcache.client import Client
    from cpcache.client.pools import take_identity

    with grpc.insecure_channel("unix:" + path) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            out["health"] = f"{exc.code().name}: {exc.details()}"
    try:
        with Client(path, timeout_s=10) as client:
            out["status"] = client.status().state
    except Exception as exc:  # noqa: BLE001 (reported, the test judges)
        out["status"] = f"{type(exc).__name__}: {exc}"
    try:
        pidfd, ring = take_identity(path, timeout_s=10)
        with open(f"/proc/self/fdinfo/{pidfd}") as info:
            out["identity_pid"] = int(next(line.split()[1] for line in info if line.startswith("Pid:")))
        os.close(pidfd)
        if ring >= 0:
            os.close(ring)
    except Exception as exc:  # noqa: BLE001
        out["identity_pid"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
