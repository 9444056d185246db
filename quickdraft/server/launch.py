"""Running the app under uvicorn, with a graceful shutdown.

On SIGTERM (or SIGINT) the server drains first: new generation requests get 503 and /health turns 503,
requests in flight finish (for at most the grace period, then they end with an error), and only then does
uvicorn close its sockets and the process exit (status 0). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from quickdraft.api import LLM, freeze_loaded_objects
from quickdraft.server.app import ServerConfig, ServerState, create_app

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: the drain shows among its shutdown lines


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._drain_task: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler (also callable from another thread, as tests do)."""
        if self._drain_started or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal: uvicorn's own shutdown, now
            return
        self._drain_started = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        log.info("Draining: new requests get 503; waiting up to %g s for %d unfinished sequences",
                 self.grace_s, self.state.engine.num_unfinished)
        try:
            await self.state.drain(self.grace_s)
        finally:
            self.should_exit = True


def make_server(llm: LLM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> GracefulServer:
    app = create_app(llm, config)
    uvicorn_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    # the drain has already waited for generations: this only bounds the
                                    # wait for connections that are still open
                                    timeout_graceful_shutdown=5)
    return GracefulServer(uvicorn_config, app.state.server, config.drain_grace_s)


def run_server(llm: LLM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> None:
    server = make_server(llm, config, host, port, log_level)
    freeze_loaded_objects()  # this process serves this LLM until it stops
    server.run()


__all__ = ["GracefulServer", "make_server", "run_server"]
