from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "feature_layer_ids", "return_features", "feature_dtype", "feature_rows", "queue_for_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FOR_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    return_features: bool
    feature_dtype: str
    feature_rows: int
    queue_for_pages: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ..., return_features: _Optional[bool] = ..., feature_dtype: _Optional[str] = ..., feature_rows: _Optional[int] = ..., queue_for_pages: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "features", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    features: _common_pb2.Tensor
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class TreeProposal(_message.Message):
    __slots__ = ("request_id", "draft_tokens", "parents", "num_generated")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    num_generated: int
    def __init__(self, request_id: _Optional[str] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., num_generated: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("trees", "plain_steps", "feature_rows")
    TREES_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[TreeProposal]
    plain_steps: int
    feature_rows: int
    def __init__(self, trees: _Optional[_Iterable[_Union[TreeProposal, _Mapping]]] = ..., plain_steps: _Optional[int] = ..., feature_rows: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "tokens", "num_accepted_drafts", "num_feature_rows", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_drafts: int
    num_feature_rows: int
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., num_accepted_drafts: _Optional[int] = ..., num_feature_rows: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "features")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    features: _common_pb2.Tensor
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class TargetServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TargetServiceGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "prompt_tokens", "completion_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TargetServiceGetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetServiceGetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "hidden_size", "num_layers", "max_context_len", "eos_token_ids", "dtype", "device", "kv", "num_running", "max_draft_tokens", "num_waiting_for_pages", "prefill_chunk_tokens", "verify_lane_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    kv: _common_pb2.KVStats
    num_running: int
    max_draft_tokens: int
    num_waiting_for_pages: int
    prefill_chunk_tokens: int
    verify_lane_port: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_context_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv: _Optional[_Union[_common_pb2.KVStats, _Mapping]] = ..., num_running: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., num_waiting_for_pages: _Optional[int] = ..., prefill_chunk_tokens: _Optional[int] = ..., verify_lane_port: _Optional[int] = ...) -> None: ...
