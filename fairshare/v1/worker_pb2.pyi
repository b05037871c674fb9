from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_INTERACTIVE: _ClassVar[Tier]
    TIER_BATCH: _ClassVar[Tier]
    TIER_BACKGROUND: _ClassVar[Tier]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_HANDED_BACK: _ClassVar[FinishReason]
TIER_UNSPECIFIED: Tier
TIER_INTERACTIVE: Tier
TIER_BATCH: Tier
TIER_BACKGROUND: Tier
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_HANDED_BACK: FinishReason

class Tenant(_message.Message):
    __slots__ = ("id", "weight", "tier", "cache_namespace")
    ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    id: str
    weight: float
    tier: Tier
    cache_namespace: str
    def __init__(self, id: _Optional[str] = ..., weight: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "grammar")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    grammar: Grammar
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "prompt_token_ids", "sampling", "cache_salt", "may_hand_back")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAY_HAND_BACK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: Tenant
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    may_hand_back: bool
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[_Union[Tenant, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., may_hand_back: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_s", "first_token_s", "queued_iterations", "first_token_iterations", "iteration")
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    queued_s: float
    first_token_s: float
    queued_iterations: int
    first_token_iterations: int
    iteration: int
    def __init__(self, queued_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., queued_iterations: _Optional[int] = ..., first_token_iterations: _Optional[int] = ..., iteration: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text_delta", "finish_reason", "usage", "timings", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateManyIn(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: _containers.RepeatedCompositeFieldContainer[GenerateOpen]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, open: _Optional[_Iterable[_Union[GenerateOpen, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateOpen(_message.Message):
    __slots__ = ("request", "metadata", "timeout_s")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    metadata: _containers.ScalarMap[str, str]
    timeout_s: float
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GenerateManyOut(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[GenerateEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[GenerateEvent, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "response", "end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    end: GenerateEnd
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[GenerateEnd, _Mapping]] = ...) -> None: ...

class GenerateEnd(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

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

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "max_context_tokens", "tokenizer_json", "chat_template", "eos_token_ids", "tokenizer_sha256", "bos_token", "eos_token", "served_model_names", "worker_id", "generate_many")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_MANY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_context_tokens: int
    tokenizer_json: str
    chat_template: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_sha256: str
    bos_token: str
    eos_token: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    worker_id: str
    generate_many: bool
    def __init__(self, model_name: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_sha256: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., worker_id: _Optional[str] = ..., generate_many: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantLoad(_message.Message):
    __slots__ = ("tenant_id", "weight", "tier", "virtual_counter", "charged_service", "prompt_tokens", "output_tokens", "waiting", "running", "kv_blocks", "finished", "preemptions", "kv_soft_quota_blocks", "kv_hard_cap_blocks", "kv_over_quota", "quota_waits", "cache_blocks", "cached_prompt_tokens", "backlogged", "pool_service")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_COUNTER_FIELD_NUMBER: _ClassVar[int]
    CHARGED_SERVICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_SOFT_QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HARD_CAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_OVER_QUOTA_FIELD_NUMBER: _ClassVar[int]
    QUOTA_WAITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKLOGGED_FIELD_NUMBER: _ClassVar[int]
    POOL_SERVICE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    weight: float
    tier: Tier
    virtual_counter: float
    charged_service: float
    prompt_tokens: int
    output_tokens: int
    waiting: int
    running: int
    kv_blocks: int
    finished: int
    preemptions: int
    kv_soft_quota_blocks: int
    kv_hard_cap_blocks: int
    kv_over_quota: bool
    quota_waits: int
    cache_blocks: int
    cached_prompt_tokens: int
    backlogged: bool
    pool_service: float
    def __init__(self, tenant_id: _Optional[str] = ..., weight: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ..., virtual_counter: _Optional[float] = ..., charged_service: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., finished: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_soft_quota_blocks: _Optional[int] = ..., kv_hard_cap_blocks: _Optional[int] = ..., kv_over_quota: _Optional[bool] = ..., quota_waits: _Optional[int] = ..., cache_blocks: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., backlogged: _Optional[bool] = ..., pool_service: _Optional[float] = ...) -> None: ...

class TierLoad(_message.Message):
    __slots__ = ("tier", "charged_service", "service_share", "min_share", "deficit", "backlogged", "blocked_iterations", "waiting", "running", "preemptions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHARGED_SERVICE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_SHARE_FIELD_NUMBER: _ClassVar[int]
    MIN_SHARE_FIELD_NUMBER: _ClassVar[int]
    DEFICIT_FIELD_NUMBER: _ClassVar[int]
    BACKLOGGED_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    charged_service: float
    service_share: float
    min_share: float
    deficit: float
    backlogged: bool
    blocked_iterations: int
    waiting: int
    running: int
    preemptions: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., charged_service: _Optional[float] = ..., service_share: _Optional[float] = ..., min_share: _Optional[float] = ..., deficit: _Optional[float] = ..., backlogged: _Optional[bool] = ..., blocked_iterations: _Optional[int] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("waiting", "running", "kv_blocks_used", "kv_blocks_total", "kv_block_size", "tenants", "policy", "iterations", "draining", "inflight_tokens", "kv_quota_enabled", "reclaim_preemptions", "cache_blocks", "cache_public_blocks", "cache_hit_tokens", "cache_lookup_tokens", "tiers", "tier_scheduling", "tier_preemptions", "returning_preemptions", "iteration_token_target", "worker_id", "pool_counters", "pool_workers", "pool_board_age_s")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_QUOTA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PUBLIC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    TIER_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RETURNING_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TOKEN_TARGET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    POOL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    POOL_BOARD_AGE_S_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantLoad]
    policy: str
    iterations: int
    draining: bool
    inflight_tokens: int
    kv_quota_enabled: bool
    reclaim_preemptions: int
    cache_blocks: int
    cache_public_blocks: int
    cache_hit_tokens: int
    cache_lookup_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierLoad]
    tier_scheduling: bool
    tier_preemptions: int
    returning_preemptions: int
    iteration_token_target: int
    worker_id: str
    pool_counters: bool
    pool_workers: int
    pool_board_age_s: float
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantLoad, _Mapping]]] = ..., policy: _Optional[str] = ..., iterations: _Optional[int] = ..., draining: _Optional[bool] = ..., inflight_tokens: _Optional[int] = ..., kv_quota_enabled: _Optional[bool] = ..., reclaim_preemptions: _Optional[int] = ..., cache_blocks: _Optional[int] = ..., cache_public_blocks: _Optional[int] = ..., cache_hit_tokens: _Optional[int] = ..., cache_lookup_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierLoad, _Mapping]]] = ..., tier_scheduling: _Optional[bool] = ..., tier_preemptions: _Optional[int] = ..., returning_preemptions: _Optional[int] = ..., iteration_token_target: _Optional[int] = ..., worker_id: _Optional[str] = ..., pool_counters: _Optional[bool] = ..., pool_workers: _Optional[int] = ..., pool_board_age_s: _Optional[float] = ...) -> None: ...
