"""`offload serve`: the app on uvicorn, with a shutdown that drains.

SIGTERM (or Ctrl-C) starts a drain: new requests get 503, running ones finish, bounded by --drain-timeout (then
they are aborted), and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

import uvicorn

from offload.common.errors import OffloadError
from offload.server.app import Server, create_app
from offload.server.settings import ServeSettings


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app_server: Server) -> None:
        super().__init__(config)
        self.app_server = app_server
        self._drain_started = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        print("draining: new requests get 503, running ones finish", file=sys.stderr, flush=True)
        aborted = await self.app_server.drain()
        if aborted:
            print(f"drain timeout: {aborted} requests aborted", file=sys.stderr, flush=True)
        self.should_exit = True


DRAIN_JOIN = 10.0  # seconds to wait at exit for the engine's thread to end its step


def serve(load: Callable[[], object], settings: ServeSettings) -> None:
    """Serve on settings.host and settings.port until a signal ends it; OffloadError if the model fails to load."""
    host, port = settings.host, settings.port
    holder: dict[str, uvicorn.Server] = {}

    def ready(server: Server) -> None:
        llm = server.llm
        print(
            f"serving {settings.model_name!r} on http://{host}:{port}/v1 (context {llm.max_model_len} tokens, "
            f"{llm.config.max_num_seqs} sequences per step, up to {settings.max_waiting} waiting)",
            file=sys.stderr,
            flush=True,
        )

    def failed(exc: BaseException) -> None:
        holder["server"].should_exit = True

    app_server = Server(load, settings, on_ready=ready, on_load_error=failed)
    config = uvicorn.Config(
        create_app(app_server),
        host=host,
        port=port,
        log_level=settings.log_level,
        lifespan="on",
        timeout_keep_alive=30,
    )
    holder["server"] = server = _DrainingServer(config, app_server)
    server.run()
    if app_server.llm is not None and (app_server.front is None or app_server.front.join(DRAIN_JOIN)):
        app_server.llm.close()  # KV blocks queued for disk are written before the process ends
    if app_server.load_error is not None:
        exc = app_server.load_error
        raise exc if isinstance(exc, OffloadError) else OffloadError(f"loading the model failed: {exc!r}")
    if not server.started:
        raise OffloadError(f"could not serve on {host}:{port} (see the message above)")
