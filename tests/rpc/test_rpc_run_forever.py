"""run_server_forever: SIGTERM makes the service drain (NOT_SERVING, stop) and exit cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SERVICE = textwrap.dedent(
    """
    import asyncio
    from specdec.rpc.server import run_server_forever, start_server

    async def main(shutdown):
        handle = await start_server([], ["test.Service"], "127.0.0.1", 0)
        await handle.set_serving(True)
        print("port", handle.bound_port, type(asyncio.get_running_loop()).__module__, flush=True)
        await shutdown.wait()
        print("draining", flush=True)
        await handle.stop(grace_s=1)
        print("stopped", flush=True)

    run_server_forever(main)
    """
)


def test_sigterm_drains_and_exits_zero():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = proc.stdout.readline().split()
        assert first[0] == "port" and int(first[1]) > 0, first
        assert first[2].startswith("uvloop")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.split() == ["draining", "stopped"]
