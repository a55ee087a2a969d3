from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "spec")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    spec: _common_pb2.SpecParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., spec: _Optional[_Union[_common_pb2.SpecParams, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "num_verify_steps", "tau", "accepted_per_position", "time_to_first_token_s", "total_s")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    num_verify_steps: int
    tau: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    time_to_first_token_s: float
    total_s: float
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_verify_steps: _Optional[int] = ..., tau: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., time_to_first_token_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class DraftServiceGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "final")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DraftServiceGetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServiceGetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "draft_vocab_size", "target", "spec", "kv", "num_running", "max_context_len")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    draft_vocab_size: int
    target: str
    spec: _common_pb2.SpecParams
    kv: _common_pb2.KVStats
    num_running: int
    max_context_len: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., draft_vocab_size: _Optional[int] = ..., target: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.SpecParams, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KVStats, _Mapping]] = ..., num_running: _Optional[int] = ..., max_context_len: _Optional[int] = ...) -> None: ...
