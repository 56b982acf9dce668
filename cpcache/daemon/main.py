"""The `cpcached` entry point: resolve settings, run the daemon on uvloop,
exit with a code that says how it ended."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys

from cpcache.daemon.budget import raise_file_limit
from cpcache.daemon.listeners import check_listener_settings
from cpcache.daemon.server import Daemon, ExitCode
from cpcache.daemon.settings import resolve
from cpcache.errors import InvalidArgument


class EscapingFormatter(logging.Formatter):
    """One record, one line: control characters in a message (a client's
    model id with a newline, say) are escaped, so no field can forge a log
    line. Tracebacks, which the formatter adds itself, keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def escape_controls(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter(f"%(asctime)s rank{config.rank} %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    # `kill -USR1 <pid>` writes every thread's stack to the log: what a
    # daemon that stopped answering is waiting on, without stopping it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    files, need = raise_file_limit(2 if config.listen_tcp else 1)
    if files < need:
        logging.getLogger("cpcached").warning(
            "descriptors: the limit is %d but the resource budget needs %d; raise LimitNOFILE= (docs/security.md, "
            "\"Resource budget\")", files, need)
    if config.storage == "mooncake":
        # Mooncake takes some settings from the environment only: set here,
        # at the edge, from the daemon's settings, before any engine starts.
        from cpcache.dataplane.storage.mooncake import engine_environment

        os.environ.update(engine_environment(config.storage_local_hostname))
    # systemd's side of the environment, read here at the edge with the rest.
    notify_socket = os.environ.get("NOTIFY_SOCKET")
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            code = runner.run(Daemon(config, notify_socket, watchdog_usec).run())
        except InvalidArgument as exc:  # a setting found unusable only at start (a socket taken meanwhile)
            logging.getLogger("cpcached").error("%s", exc)
            return ExitCode.CONFIG
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
