"""Run a service's `serve(args, shutdown, ready)` in this process, on a private event loop in a daemon thread.

For tests, benchmarks and embedding: the gRPC path is the real one, only the process is shared.

    target = ServiceThread(target_service.app.serve, ["serve-target", "--model", DIR, "--port", "0"]).start()
    ... target.addr ...
    target.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import threading


class ServiceThread:
    def __init__(self, serve, argv: list[str]):
        from specdec.cli import build_parser

        self.args: argparse.Namespace = build_parser().parse_args(argv)
        self.serve = serve
        self.port: int | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._shutdown: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main():
            self._shutdown = asyncio.Event()
            await self.serve(self.args, self._shutdown, self._on_ready)

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced by start()
            self.error = exc
            self._ready.set()

    def _on_ready(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def start(self, timeout_s: float = 120.0) -> ServiceThread:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.error:
            raise RuntimeError(f"service did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        if self._shutdown is not None:
            self._loop.call_soon_threadsafe(self._shutdown.set)
        self._thread.join(30)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"
