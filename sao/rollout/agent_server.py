"""The OpenAI-compatible endpoint of a rollout worker: one HTTP server per worker (its event loop), on
127.0.0.1 and a free port, started with the first agent episode; it routes each call to its episode's
`AgentSession` (sao/rollout/agent_session.py) by API key.

    POST /v1/chat/completions   AgentSession.chat        POST /v1/completions   AgentSession.complete
    GET  /v1/models             one model, "sao"

Connections are bounded so that one episode's agent cannot take what another's needs (`ConnectionGuard`):
a connection belongs to the episode whose key its first request carries; an episode holds at most
`max_per_episode` of them (more: HTTP 429, then closed); one that has sent no request within
`first_request_s` is closed, and when the worker's `max_connections` are open the oldest such
connection is closed to make room. Kept-alive connections close after 5 idle seconds (uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import time
from collections import OrderedDict

from sao.rollout.agent_session import AgentSession, Refused

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) while it streams in, never buffered whole


async def read_json(request, limit: int = MAX_BODY_BYTES):
    """The request's JSON body, read up to `limit` bytes (a larger one is refused with 413 as soon as it
    says so or passes the limit); deep nesting and bad JSON raise ValueError/RecursionError (400)."""
    import json

    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise Refused(413, f"request body over {limit} bytes", "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"request body over {limit} bytes", "request_too_large")
        chunks.append(chunk)
    return json.loads(b"".join(chunks))


class ConnectionGuard:
    """The endpoint's open connections: which episode each belongs to, and the bounds above. `max_connections`
    is also held under a quarter of the process's descriptor limit, so connections never take the descriptors
    the worker's engine, environments and other agents need."""

    def __init__(self, max_connections: int = 256, max_per_episode: int = 16, first_request_s: float = 10.0):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(2, min(max_connections, soft // 4 if soft > 0 else max_connections))
        self.max_per_episode, self.first_request_s = max_per_episode, first_request_s
        self.unbound: OrderedDict = OrderedDict()  # connection -> opened at, oldest first: no request yet
        self.owner: dict = {}  # connection -> the API key of its first request
        self.by_client: dict = {}  # (host, port) of the peer -> connection
        self.refused = 0  # connections closed by a bound (for tests and the worker's logs)

    def opened(self, conn, client) -> None:
        self.by_client[client] = conn
        self.unbound[conn] = time.monotonic()
        if len(self.unbound) + len(self.owner) > self.max_connections:
            self._close(next(iter(self.unbound)))  # the oldest that has asked for nothing (maybe this one)
        if conn in self.unbound:
            asyncio.get_running_loop().call_later(self.first_request_s, self._expire, conn)

    def closed(self, conn, client) -> None:
        self.unbound.pop(conn, None)
        self.owner.pop(conn, None)
        if self.by_client.get(client) is conn:
            del self.by_client[client]

    def bind(self, client, key: str) -> bool:
        """A request with `key` arrived on the connection from `client`: False if that episode already
        holds `max_per_episode` connections. A kept-alive connection used with another key moves to it."""
        conn = self.by_client.get(client)
        if conn is None or self.owner.get(conn) == key:
            return True
        if sum(k == key for k in self.owner.values()) >= self.max_per_episode:
            return False
        self.unbound.pop(conn, None)
        self.owner[conn] = key
        return True

    def _expire(self, conn) -> None:
        if conn in self.unbound:
            self._close(conn)

    def _close(self, conn) -> None:
        self.unbound.pop(conn, None)
        self.refused += 1
        conn.transport.close()


def guarded(protocol: type, guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class with every connection reported to `guard`."""

    class Guarded(protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            guard.opened(self, self.client)

        def connection_lost(self, exc) -> None:
            guard.closed(self, self.client)
            super().connection_lost(exc)

    return Guarded


class Endpoint:
    """The worker's server: routes each call to its episode by API key."""

    def __init__(self, guard: ConnectionGuard | None = None) -> None:
        self.sessions: dict[str, AgentSession] = {}
        self.base_url = ""
        self.guard = guard or ConnectionGuard()

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def handler(method: str):
            async def handle(request):
                started = time.perf_counter()
                key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
                session = self.sessions.get(key)
                if session is None:
                    return JSONResponse(_error("unknown API key (each episode has its own)", "invalid_api_key"), 401)
                client = tuple(request.client) if request.client else None
                if not self.guard.bind(client, key):
                    return JSONResponse(_error(f"this episode already holds {self.guard.max_per_episode} connections "
                                               "(env.options.max_connections_per_episode)", "too_many_connections"),
                                        429, headers={"connection": "close"})
                try:
                    body = await read_json(request)
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                    if body.get("stream"):
                        raise Refused(400, "stream=true is not supported", "invalid_request")
                    if (body.get("n") or 1) != 1:
                        raise Refused(400, "n must be 1 (an episode is one token sequence)", "invalid_request")
                    reply = await getattr(session, method)(body)
                except Refused as exc:
                    return JSONResponse(_error(str(exc), exc.code), exc.status)
                except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:  # a malformed body
                    return JSONResponse(_error(f"invalid request: {type(exc).__name__}: {exc}"[:300], "invalid_request"), 400)
                finally:
                    session.overhead_s += time.perf_counter() - started
                return JSONResponse(reply)

            return handle

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "sao", "object": "model", "owned_by": "sao"}]})

        return Starlette(routes=[Route("/v1/chat/completions", handler("chat"), methods=["POST"]),
                                 Route("/v1/completions", handler("complete"), methods=["POST"]),
                                 Route("/v1/models", models)])

    async def start(self, host: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the rollout worker owns its process's signals
                yield

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets: without it
        # a keep-alive reply waits ~40 ms for a delayed ACK (measured: 44 ms -> 0.5 ms per call, benchmarks/integrations.py)
        sock.bind((host, 0))
        config = uvicorn.Config(self.app(), lifespan="off", log_level="warning", access_log=False)
        config.load()  # resolves the HTTP protocol class ("auto": httptools if installed, else h11)
        config.http_protocol_class = guarded(config.http_protocol_class, self.guard)
        server = Server(config)
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.base_url = f"http://{host}:{sock.getsockname()[1]}/v1"


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


_endpoints: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}


async def endpoint(host: str, guard: ConnectionGuard | None = None) -> Endpoint:
    """This event loop's endpoint, started on first use (with `guard`'s bounds)."""
    loop = asyncio.get_running_loop()
    for old in [lp for lp in _endpoints if lp.is_closed()]:  # asyncio.run per batch (sync mode): one server per loop
        del _endpoints[old]
    if loop not in _endpoints:
        ep = Endpoint(guard)
        _endpoints[loop] = loop.create_task(ep.start(host))
        _endpoints[loop].endpoint = ep
    fut = _endpoints[loop]
    await asyncio.shield(fut)
    return fut.endpoint
