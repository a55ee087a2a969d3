"""Start the real target and draft services in this process (each on its own event-loop thread, free ports)."""

from __future__ import annotations

from repo_paths import TINY

from specdec.serving.service_thread import ServiceThread

__all__ = ["ServiceThread", "start_draft", "start_target"]


def start_target(*extra: str) -> ServiceThread:
    from target_service.app import serve

    argv = ["serve-target", "--model", str(TINY / "target"), "--port", "0", "--drain-seconds", "2", *extra]
    return ServiceThread(serve, argv).start()


def start_draft(target_addr: str, *extra: str, draft: str = "draft") -> ServiceThread:
    from draft_service.app import serve

    argv = ["serve-draft", "--model", str(TINY / draft), "--target-model", str(TINY / "target"),
            "--target", target_addr, "--port", "0", "--drain-seconds", "2", "--speculation", "always", *extra]
    return ServiceThread(serve, argv).start()
