"""GPU busy fraction over a stretch of work, as `nvidia-smi` reports it: NVML's utilization (the share of the
last sample period in which a kernel was running), polled on a thread and averaged. Needs the NVIDIA driver's
libnvidia-ml.so (present wherever the driver is); no Python NVML package.

    with GpuBusy([0, 1]) as busy:
        run()
    busy.fractions  # {0: 0.93, 1: 0.41}

NVML averages over its own sample period (1/6 s to 1 s by GPU), so runs shorter than a few seconds read low or
high at the edges: time runs of several seconds.
"""

from __future__ import annotations

import ctypes
import threading
import time


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class GpuBusy:
    def __init__(self, indices: list[int], period_s: float = 0.02):
        self.indices, self.period_s = list(indices), period_s
        self.fractions: dict[int, float] = {}
        self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if self._nvml.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit failed")
        self._handles = []
        for i in self.indices:
            h = ctypes.c_void_p()
            if self._nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)) != 0:
                raise RuntimeError(f"no NVML handle for GPU {i}")
            self._handles.append(h)
        self._stop = threading.Event()
        self._sums = [0.0] * len(self.indices)
        self._count = 0

    def _poll(self) -> None:
        u = _Utilization()
        while not self._stop.is_set():
            for j, h in enumerate(self._handles):
                if self._nvml.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u)) == 0:
                    self._sums[j] += u.gpu / 100.0
            self._count += 1
            time.sleep(self.period_s)

    def __enter__(self) -> GpuBusy:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        n = max(self._count, 1)
        self.fractions = {i: round(s / n, 3) for i, s in zip(self.indices, self._sums, strict=True)}
