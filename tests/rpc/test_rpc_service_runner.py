"""run_service: once the model is loaded, what exists is frozen out of the cyclic garbage collector, so a full
collection while serving scans only what serving made (in its own process, as deployed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SERVICE = textwrap.dedent(
    """
    import asyncio, gc
    from specdec.rpc.service_runner import ServiceSpec, run_service

    class Model:  # stands for a loaded model: objects created while loading
        def __init__(self):
            self.layers = [[i] for i in range(1000)]

    held = {}

    async def load(metrics):
        held["model"] = Model()
        return "model"

    async def main():
        shutdown = asyncio.Event()

        def ready(port):
            print("frozen", gc.get_freeze_count(), flush=True)
            shutdown.set()

        async def close():
            pass

        spec = ServiceSpec("t", "test.Service", [], load, close, "127.0.0.1", 0, None, drain_s=0.1)
        await run_service(spec, shutdown, ready)

    asyncio.run(main())
    """
)


def test_objects_made_before_serving_are_frozen_out_of_the_collector():
    out = subprocess.run([sys.executable, "-c", SERVICE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    assert words[0] == "frozen" and int(words[1]) > 1000, out.stdout  # the model's lists among them
