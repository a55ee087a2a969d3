"""Start the real target and draft services in this process (each on its own event-loop thread, free ports)."""

from __future__ import annotations

import argparse
import asyncio
import threading

from repo_paths import TINY

from specdec.cli import build_parser


class ServiceThread:
    """Runs `serve(args, shutdown, ready)` on a private event loop in a daemon thread."""

    def __init__(self, serve, argv: list[str]):
        self.args: argparse.Namespace = build_parser().parse_args(argv)
        self.serve = serve
        self.port: int | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._shutdown: asyncio.Event | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main():
            self._shutdown = asyncio.Event()
            await self.serve(self.args, self._shutdown, self._on_ready)

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test
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


def start_target(*extra: str) -> ServiceThread:
    from target_service.app import serve

    argv = ["serve-target", "--model", str(TINY / "target"), "--port", "0", "--drain-seconds", "2", *extra]
    return ServiceThread(serve, argv).start()


def start_draft(target_addr: str, *extra: str, draft: str = "draft") -> ServiceThread:
    from draft_service.app import serve

    argv = ["serve-draft", "--model", str(TINY / draft), "--target-model", str(TINY / "target"),
            "--target", target_addr, "--port", "0", "--drain-seconds", "2", *extra]
    return ServiceThread(serve, argv).start()
