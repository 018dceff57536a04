"""Slow and broken clients at the socket edge: a cap on open connections, read deadlines for the request
head and body, and one INFO line (never a traceback) when a client is dropped or its request is refused
by aiohttp's own HTTP parser.

``GuardedSite`` listens like ``web.TCPSite`` but wraps each aiohttp connection handler in a
``GuardedConnection``:

- over ``max_connections`` open connections, a new one gets a 503 and is closed;
- a request head (request line and headers) must arrive within ``header_timeout_s`` of its first byte
  (or of the connection opening);
- the body is read by the handlers under ``body_timeout_s`` (``read_body``): a client that misses it gets
  a 408 and its connection is closed.

An idle keep-alive connection is closed by aiohttp's ``keepalive_timeout``.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("nightjar.api")

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
_REFUSED_BODY = (b'{"error": {"message": "too many open connections", "type": "service_unavailable", '
                 b'"param": null, "code": "too_many_connections"}}')


@dataclass(frozen=True)
class ServerLimits:
    """Per-connection limits of the HTTP server (``nightjar serve --header-timeout`` etc.)."""
    header_timeout_s: float = 10.0       # first byte of a request -> its complete head
    body_timeout_s: float = 30.0         # the whole body, once the head is in
    max_connections: int = 512           # open client connections; more get a 503 and are closed
    keepalive_timeout_s: float = 75.0    # an idle keep-alive connection is closed after this

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections})")


def _peer(transport) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "?")


class GuardedConnection(asyncio.Protocol):
    """One client connection: forwards to aiohttp's handler (made only once the connection is accepted)
    and enforces the head deadline; the app's middleware marks when a request is being handled."""

    def __init__(self, guard: "ConnectionGuard", make_handler) -> None:
        self.guard, self.make_handler = guard, make_handler
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = 0                    # requests of this connection inside the app

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.guard.admit(self):
            return
        self.inner = self.make_handler()
        self.inner.connection_made(transport)
        self.arm(self.guard.limits.header_timeout_s, "no complete request head")

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if not self.busy and self.timer is None:         # a new request starts on a kept-alive connection
            self.arm(self.guard.limits.header_timeout_s, "no complete request head")
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        self.disarm()
        self.guard.release(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ---- deadlines ---------------------------------------------------------------------------------
    def arm(self, seconds: float, why: str, force: bool = False) -> None:
        self.disarm()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(seconds, self._expired, seconds, why, force)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self, seconds: float, why: str, force: bool) -> None:
        self.timer = None
        if (self.busy and not force) or self.transport is None or self.transport.is_closing():
            return
        if why:
            log.info("dropped client %s: %s within %g s", _peer(self.transport), why, seconds)
        self.transport.close()


class ConnectionGuard:
    """The open connections of one app and its limits (``create_app`` makes one; ``GuardedSite`` uses it)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.open: dict[object, GuardedConnection] = {}     # transport -> connection
        self.num_refused = self.num_dropped = 0

    def factory(self, server: web.Server):
        return lambda: GuardedConnection(self, server)

    def admit(self, conn: GuardedConnection) -> bool:
        t = conn.transport
        if len(self.open) >= self.limits.max_connections:
            self.num_refused += 1
            log.info("refused client %s: %d connections are open (the limit)", _peer(t), len(self.open))
            t.write(_REFUSED % (len(_REFUSED_BODY), _REFUSED_BODY))
            t.close()
            return False
        self.open[t] = conn
        return True

    def release(self, conn: GuardedConnection) -> None:
        self.open.pop(conn.transport, None)

    # ---- called from the app's middleware and body reader ----------------------------------------------
    def connection_of(self, request: web.BaseRequest) -> GuardedConnection | None:
        return self.open.get(request.transport)

    def request_started(self, request: web.BaseRequest) -> GuardedConnection | None:
        conn = self.connection_of(request)
        if conn is not None:
            conn.busy += 1
            conn.disarm()
        return conn

    @staticmethod
    def request_finished(conn: GuardedConnection | None) -> None:
        if conn is not None:
            conn.busy -= 1

    def drop_after_response(self, conn: GuardedConnection | None) -> None:
        """Close the connection shortly after the current response (time for it to be written)."""
        if conn is not None:
            self.num_dropped += 1
            conn.arm(1.0, "", force=True)


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with the app's ``ConnectionGuard`` between the listener and aiohttp's handlers."""

    def __init__(self, runner: web.AppRunner, host: str | None, port: int, guard: ConnectionGuard,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        port = self._server.sockets[0].getsockname()[1] if self._server and self._server.sockets else self._port
        return f"http://{self._host or '0.0.0.0'}:{port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.factory(self._runner.server), self._host, self._port,
                                                backlog=self._backlog, reuse_address=True)


class ParserErrorLog(logging.LoggerAdapter):
    """aiohttp's server logger with one change: a request its HTTP parser rejects (a header over the size
    limit, Transfer-Encoding with Content-Length, a body that does not decode, ...) is one INFO line, not a
    traceback at ERROR."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if isinstance(exc_info, (HttpProcessingError, RequestPayloadError)):
            peer = f" from {args[0]}" if args else ""
            why = " ".join(str(getattr(exc_info, "message", "") or exc_info).split())[:200]
            log.info("rejected a malformed request%s: %s (%s)", peer, why, type(exc_info).__name__)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)
