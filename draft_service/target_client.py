"""A blocking TargetService client for the draft's engine thread: engine dataclasses in and out, gRPC errors
turned back into the engine's exceptions (so the scheduler handles a remote target like a local one)."""

from __future__ import annotations

import grpc

from specdec.engine.requests import PrefillInput, PrefillOutput, VerifyInput, VerifyOutput
from specdec.errors import InvalidInput, NotReady, OutOfPages, SpecdecError, UnknownRequest
from specdec.rpc.options import channel_options
from specdec.rpc.target_codec import (
    prefill_output_from_proto,
    prefill_to_proto,
    verify_outputs_from_proto,
    verify_to_proto,
)
from specdec.rpc.tls import TlsConfig
from specdec.v1 import target_pb2, target_pb2_grpc

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.NOT_FOUND: UnknownRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OutOfPages,
    grpc.StatusCode.UNAVAILABLE: NotReady,
}


def _translate(exc: grpc.RpcError) -> SpecdecError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, SpecdecError)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        cls = NotReady
    return cls(f"target: {details}")


class TargetClient:
    """Implements the engine-side target interface (`prefill`, `verify`, `release`) over gRPC."""

    def __init__(self, addr: str, tls: TlsConfig | None = None, timeout_s: float = 60.0, device=None):
        opts = channel_options()
        self.channel = (grpc.secure_channel(addr, tls.channel_credentials(), options=opts) if tls
                        else grpc.insecure_channel(addr, options=opts))
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.addr, self.timeout_s, self.device = addr, timeout_s, device

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _translate(exc) from None

    def prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        return [prefill_output_from_proto(self._call(self.stub.Prefill, prefill_to_proto(i)), self.device)
                for i in inputs]

    def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
        return verify_outputs_from_proto(self._call(self.stub.Verify, verify_to_proto(inputs)), self.device)

    def release(self, request_id: str) -> None:
        self._call(self.stub.Release, target_pb2.ReleaseRequest(request_ids=[request_id]))

    def model_info(self) -> target_pb2.TargetServiceGetModelInfoResponse:
        return self._call(self.stub.GetModelInfo, target_pb2.TargetServiceGetModelInfoRequest())

    def close(self) -> None:
        self.channel.close()
