"""The OpenAI-compatible endpoint of a rollout worker: one HTTP server per worker (its event loop), on
127.0.0.1 and a free port, started with the first agent episode; it routes each call to its episode's
`AgentSession` (sao/rollout/agent_session.py) by API key.

    POST /v1/chat/completions   AgentSession.chat        POST /v1/completions   AgentSession.complete
    GET  /v1/models             one model, "sao"
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

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


class Endpoint:
    """The worker's server: routes each call to its episode by API key."""

    def __init__(self) -> None:
        self.sessions: dict[str, AgentSession] = {}
        self.base_url = ""

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
        server = Server(uvicorn.Config(self.app(), lifespan="off", log_level="warning", access_log=False))
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.base_url = f"http://{host}:{sock.getsockname()[1]}/v1"


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


_endpoints: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}


async def endpoint(host: str) -> Endpoint:
    """This event loop's endpoint, started on first use."""
    loop = asyncio.get_running_loop()
    for old in [lp for lp in _endpoints if lp.is_closed()]:  # asyncio.run per batch (sync mode): one server per loop
        del _endpoints[old]
    if loop not in _endpoints:
        ep = Endpoint()
        _endpoints[loop] = loop.create_task(ep.start(host))
        _endpoints[loop].endpoint = ep
    fut = _endpoints[loop]
    await asyncio.shield(fut)
    return fut.endpoint
