"""Tensors <-> `specdec.v1.Tensor` (raw row-major little-endian bytes with a dtype name and a shape).

Hidden states cross the draft/target boundary as one blob per batch; this module is the only place that
packs and unpacks them. bfloat16 travels as its raw 16-bit pattern (no float conversion), and decoding
wraps the received bytes without copying (`torch.frombuffer`) when no device move is asked for.

A draft may ask for its features as 8-bit floats with a scale per row (`FP8_ROWS`, about half of bf16's bytes):
the target packs them on its device (`pack_fp8_rows`: a uint8 tensor, each row its fp8 bytes then its float32
scale: the only uint8 tensors that travel), the draft unpacks them on its own (`tensor_from_proto`).
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from specdec.errors import InvalidInput
from specdec.host_copy import to_device
from specdec.v1 import common_pb2

# dtype name on the wire -> torch dtype.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_NAMES = {dt: name for name, dt in _DTYPES.items()}
FP8_ROWS = "float8_e4m3fn_rowscaled"  # [rows, cols]: each row cols float8 e4m3fn bytes, then a float32 scale
FEATURE_DTYPES = ("", FP8_ROWS)  # what PrefillRequest.feature_dtype may ask for ("": the compute dtype)
_FP8_MAX = 448.0  # largest finite float8 e4m3fn

if sys.byteorder != "little":  # pragma: no cover - the wire format is the host's raw bytes
    raise ImportError("specdec.rpc.tensor_codec supports little-endian hosts only")


def tensor_to_proto(t: torch.Tensor, out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """Pack `t` (float32, bfloat16 or float16, any device) into a Tensor message (`out`, e.g. a reply's field,
    filled in place: no second copy of the bytes; else a new one).

    The bytes are those of a contiguous CPU copy; bf16/fp16 are reinterpreted as int16, never converted.
    """
    name, shape, raw = host_raw(t)
    data = raw.tobytes()
    if out is None:
        return common_pb2.Tensor(dtype=name, shape=shape, data=data)
    out.dtype, out.data = name, data
    del out.shape[:]
    out.shape.extend(shape)
    return out


def host_raw(t: torch.Tensor):
    """(wire dtype name, shape, the elements as a flat uint8 array) of `t`: the bytes of a contiguous host copy
    (no copy for a contiguous host tensor), bf16/fp16 reinterpreted, never converted. The array shares `t`'s
    memory when it can. A uint8 [rows, cols + 4] tensor is `pack_fp8_rows` output: FP8_ROWS, shape [rows, cols]."""
    if t.dtype == torch.uint8 and t.dim() == 2:
        name, shape = FP8_ROWS, [t.shape[0], t.shape[1] - 4]
    else:
        name, shape = tensor_dtype_name(t.dtype), list(t.shape)
    cpu = t.detach().to("cpu").contiguous()
    return name, shape, cpu.reshape(-1).view(torch.uint8).numpy()


def pack_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, cols] floats -> uint8 [rows, cols + 4] on x's device: each row scaled so its largest magnitude is
    float8 e4m3fn's largest (448), rounded to float8, followed by the scale as float32 bytes."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / _FP8_MAX  # [rows, 1]
    q = (xf / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q, scale.view(torch.uint8)], dim=1)


def unpack_fp8_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols + 4] (`pack_fp8_rows`) -> float32 [rows, cols], on packed's device."""
    cols = packed.shape[1] - 4
    values = packed[:, :cols].contiguous().view(torch.float8_e4m3fn).float()
    return values * packed[:, cols:].contiguous().view(torch.float32)


def tensor_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype` (InvalidInput for a dtype the wire does not carry)."""
    name = _NAMES.get(dtype)
    if name is None:
        raise InvalidInput(f"cannot send a {dtype} tensor; supported dtypes: {sorted(_DTYPES)}")
    return name


def tensor_from_proto(
    msg: common_pb2.Tensor,
    device: torch.device | str | None = None,
    expected_dim: int | None = None,
    expected_rows: int | None = None,
) -> torch.Tensor:
    """Unpack a Tensor message, checking it first; raise InvalidInput with a clear message if it is malformed.

    expected_dim / expected_rows, when given, check the last dimension and the first dimension (a 2-D
    [rows, dim] feature blob is the common case). Without `device` the result shares memory with
    `msg.data` (read-only: do not write into it; `.clone()` first if you must).
    """
    if msg.dtype == FP8_ROWS:
        return _fp8_rows_from_proto(msg, device, expected_dim, expected_rows)
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidInput(f"tensor dtype {msg.dtype!r} is not one of {sorted([*_DTYPES, FP8_ROWS])}")
    shape = tuple(msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidInput(f"tensor shape {list(shape)} has a negative dimension")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    if len(msg.data) != numel * itemsize:
        raise InvalidInput(
            f"tensor data is {len(msg.data)} bytes but shape {list(shape)} of {msg.dtype} "
            f"needs {numel * itemsize}"
        )
    _check_expected(shape, expected_dim, expected_rows)
    t = torch.empty(shape, dtype=dtype) if numel == 0 else _alias_bytes(msg.data, dtype).view(shape)
    return t if device is None else to_device(t, device)


def _fp8_rows_from_proto(msg, device, expected_dim: int | None, expected_rows: int | None) -> torch.Tensor:
    """An FP8_ROWS tensor, checked, moved (still 8-bit) to `device` and unpacked there. # float32 [rows, cols]"""
    shape = tuple(msg.shape)
    if len(shape) != 2 or min(shape) < 0:
        raise InvalidInput(f"{FP8_ROWS} tensor shape {list(shape)}: expected [rows, cols]")
    rows, cols = shape
    if len(msg.data) != rows * (cols + 4):
        raise InvalidInput(f"tensor data is {len(msg.data)} bytes but {FP8_ROWS} {list(shape)} needs "
                           f"{rows * (cols + 4)}")
    _check_expected(shape, expected_dim, expected_rows)
    if rows == 0:
        return torch.empty(shape, dtype=torch.float32, device=device)
    packed = _alias_bytes(msg.data, torch.uint8).view(rows, cols + 4)
    return unpack_fp8_rows(packed if device is None else to_device(packed, device))


def _check_expected(shape: tuple[int, ...], expected_dim: int | None, expected_rows: int | None) -> None:
    if expected_dim is not None and (not shape or shape[-1] != expected_dim):
        raise InvalidInput(f"tensor shape {list(shape)}: expected last dimension {expected_dim}")
    if expected_rows is not None and (not shape or shape[0] != expected_rows):
        raise InvalidInput(f"tensor shape {list(shape)}: expected {expected_rows} rows")


def _alias_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over `data` without a copy. torch warns that `bytes` is not writable; we only read it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype)
