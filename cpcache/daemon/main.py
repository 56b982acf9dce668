"""The `cpcached` entry point: resolve settings, run the daemon on uvloop,
exit with a code that says how it ended."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from cpcache.daemon.listeners import check_listener_settings
from cpcache.daemon.server import Daemon, ExitCode
from cpcache.daemon.settings import resolve
from cpcache.errors import InvalidArgument


def loop_factory() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux; asyncio's loop works too
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    try:
        config = resolve(argv)
        check_listener_settings(config)
    except InvalidArgument as exc:
        print(f"cpcached: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s rank{config.rank} %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # systemd's side of the environment, read here at the edge with the rest.
    notify_socket = os.environ.get("NOTIFY_SOCKET")
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        code = runner.run(Daemon(config, notify_socket, watchdog_usec).run())
    logging.getLogger("cpcached").info("exit code %d (%s)", code, ExitCode(code).name)
    return int(code)


def run() -> None:
    """Console entry point. Exits without joining I/O threads: one stuck in
    a storage call that never returns must not keep a stopped daemon alive."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
