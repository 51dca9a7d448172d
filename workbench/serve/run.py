"""Start `hcw serve`: refuse an unauthenticated non-loopback address, bind the socket first (a
port in use is one line, and port 0 picks a free one), load the model, say where it listens on
stdout, and serve with uvicorn until SIGINT or SIGTERM; then stop the scheduler, close the file
and exit 0."""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
from typing import TextIO

import uvicorn

from workbench.serve.app import create_app
from workbench.serve.served import Served, ServeOptions


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, insecure_no_auth: bool) -> None:
    """A server reachable from other machines answers only to a key, unless told otherwise."""
    if not loopback(host) and api_key is None and not insecure_no_auth:
        raise ValueError(f"--host {host} is reachable from other machines: give --api-key KEY (or HCW_API_KEY), "
                         "or --insecure-no-auth to serve without one")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def serve(opts: ServeOptions, host: str, port: int, out: TextIO = sys.stdout) -> None:
    sock = bind(host, port)
    served = Served(opts).start()
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again: both end here
    # as KeyboardInterrupt (one that comes before uvicorn listens, too), so the scheduler stops and
    # the workbench file closes before exit 0
    previous = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    try:
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        line = (f"hcw serve: {served.name} on http://{shown}:{bound}/v1 (batch up to {opts.max_batch}, "
                f"workbench file {served.tier.path}){'; API key required' if opts.api_key else ''}\n")
        config = uvicorn.Config(create_app(served), log_level="warning", timeout_graceful_shutdown=5)
        _Announcing(config, out, line).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        served.close()
        sock.close()


class _Announcing(uvicorn.Server):
    """uvicorn's server that writes the ready line once it has started, its signal handlers in place:
    a SIGTERM sent on reading that line lands in uvicorn's graceful shutdown, not in its start-up
    (where one ended the process by SIGINT, exit -2, about one time in four)."""

    def __init__(self, config: uvicorn.Config, out: TextIO, line: str):
        super().__init__(config)
        self._out, self._line = out, line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self._out.write(self._line)
            self._out.flush()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
