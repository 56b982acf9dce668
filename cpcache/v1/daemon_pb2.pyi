from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reduce(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_UNSPECIFIED: _ClassVar[Reduce]
    REDUCE_MIN: _ClassVar[Reduce]
    REDUCE_MAX: _ClassVar[Reduce]
REDUCE_UNSPECIFIED: Reduce
REDUCE_MIN: Reduce
REDUCE_MAX: Reduce

class Geometry(_message.Message):
    __slots__ = ("layers", "kv_kind", "heads", "head_dim", "dtype", "page_size", "beside")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_KIND_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BESIDE_FIELD_NUMBER: _ClassVar[int]
    layers: int
    kv_kind: str
    heads: int
    head_dim: int
    dtype: str
    page_size: int
    beside: _containers.RepeatedCompositeFieldContainer[PagePart]
    def __init__(self, layers: _Optional[int] = ..., kv_kind: _Optional[str] = ..., heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., beside: _Optional[_Iterable[_Union[PagePart, _Mapping]]] = ...) -> None: ...

class PagePart(_message.Message):
    __slots__ = ("name", "rows_per_page", "width", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows_per_page: int
    width: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., rows_per_page: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class PoolRegion(_message.Message):
    __slots__ = ("offset", "strides", "cuda_ipc")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    offset: int
    strides: _containers.RepeatedScalarFieldContainer[int]
    cuda_ipc: CudaIpcHandle
    def __init__(self, offset: _Optional[int] = ..., strides: _Optional[_Iterable[int]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model_id", "geometry", "device_pages", "shm_path", "cuda_ipc", "shm_ticket", "topology", "regions", "load_signals", "model_dtype", "attempt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHM_TICKET_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SIGNALS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    geometry: Geometry
    device_pages: int
    shm_path: str
    cuda_ipc: CudaIpcHandle
    shm_ticket: str
    topology: SchedulerTopology
    regions: _containers.RepeatedCompositeFieldContainer[PoolRegion]
    load_signals: LoadSignals
    model_dtype: str
    attempt: int
    def __init__(self, model_id: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., device_pages: _Optional[int] = ..., shm_path: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., shm_ticket: _Optional[str] = ..., topology: _Optional[_Union[SchedulerTopology, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[PoolRegion, _Mapping]]] = ..., load_signals: _Optional[_Union[LoadSignals, _Mapping]] = ..., model_dtype: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class LoadSignals(_message.Message):
    __slots__ = ("shm_ticket", "slots", "cuda_events")
    SHM_TICKET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENTS_FIELD_NUMBER: _ClassVar[int]
    shm_ticket: str
    slots: int
    cuda_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, shm_ticket: _Optional[str] = ..., slots: _Optional[int] = ..., cuda_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SchedulerTopology(_message.Message):
    __slots__ = ("tp", "cp", "dp", "pp", "rank")
    TP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    tp: int
    cp: int
    dp: int
    pp: int
    rank: int
    def __init__(self, tp: _Optional[int] = ..., cp: _Optional[int] = ..., dp: _Optional[int] = ..., pp: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("page_bytes", "host_pages", "host_layout", "storage", "key_seed", "resumed_pages", "epoch", "host_pool_ticket", "last_step", "daemon_instance")
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    KEY_SEED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_TICKET_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    page_bytes: int
    host_pages: int
    host_layout: str
    storage: str
    key_seed: str
    resumed_pages: int
    epoch: int
    host_pool_ticket: str
    last_step: int
    daemon_instance: int
    def __init__(self, page_bytes: _Optional[int] = ..., host_pages: _Optional[int] = ..., host_layout: _Optional[str] = ..., storage: _Optional[str] = ..., key_seed: _Optional[str] = ..., resumed_pages: _Optional[int] = ..., epoch: _Optional[int] = ..., host_pool_ticket: _Optional[str] = ..., last_step: _Optional[int] = ..., daemon_instance: _Optional[int] = ...) -> None: ...

class PrefetchOp(_message.Message):
    __slots__ = ("op_id", "pages", "tokens", "parent", "hold")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: int
    parent: bytes
    hold: bool
    def __init__(self, op_id: _Optional[int] = ..., pages: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[int] = ..., parent: _Optional[bytes] = ..., hold: _Optional[bool] = ...) -> None: ...

class WriteOp(_message.Message):
    __slots__ = ("op_id", "pages", "device_pages", "parent")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    parent: bytes
    def __init__(self, op_id: _Optional[int] = ..., pages: _Optional[_Iterable[bytes]] = ..., device_pages: _Optional[_Iterable[int]] = ..., parent: _Optional[bytes] = ...) -> None: ...

class LoadOp(_message.Message):
    __slots__ = ("op_id", "pages", "device_pages", "signal_slot")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_SLOT_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    signal_slot: int
    def __init__(self, op_id: _Optional[int] = ..., pages: _Optional[_Iterable[bytes]] = ..., device_pages: _Optional[_Iterable[int]] = ..., signal_slot: _Optional[int] = ...) -> None: ...

class WaitLoadsRequest(_message.Message):
    __slots__ = ("op_ids", "timeout_s")
    OP_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    op_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, op_ids: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitLoadsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("pages", "host_only")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_ONLY_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    host_only: bool
    def __init__(self, pages: _Optional[_Iterable[bytes]] = ..., host_only: _Optional[bool] = ...) -> None: ...

class MatchReply(_message.Message):
    __slots__ = ("host_pages", "storage_pages")
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    host_pages: int
    storage_pages: int
    def __init__(self, host_pages: _Optional[int] = ..., storage_pages: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("counters",)
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Votes(_message.Message):
    __slots__ = ("op_ids", "reduces", "values")
    OP_IDS_FIELD_NUMBER: _ClassVar[int]
    REDUCES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    op_ids: _containers.RepeatedScalarFieldContainer[int]
    reduces: _containers.RepeatedScalarFieldContainer[Reduce]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op_ids: _Optional[_Iterable[int]] = ..., reduces: _Optional[_Iterable[_Union[Reduce, str]]] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class Decisions(_message.Message):
    __slots__ = ("op_ids", "values")
    OP_IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    op_ids: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op_ids: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step", "votes", "prefetches", "prefetch_polls", "revokes", "writes", "loads", "epoch", "hold_releases")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_POLLS_FIELD_NUMBER: _ClassVar[int]
    REVOKES_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLD_RELEASES_FIELD_NUMBER: _ClassVar[int]
    step: int
    votes: Votes
    prefetches: _containers.RepeatedCompositeFieldContainer[PrefetchOp]
    prefetch_polls: _containers.RepeatedScalarFieldContainer[int]
    revokes: _containers.RepeatedScalarFieldContainer[int]
    writes: _containers.RepeatedCompositeFieldContainer[WriteOp]
    loads: _containers.RepeatedCompositeFieldContainer[LoadOp]
    epoch: int
    hold_releases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., votes: _Optional[_Union[Votes, _Mapping]] = ..., prefetches: _Optional[_Iterable[_Union[PrefetchOp, _Mapping]]] = ..., prefetch_polls: _Optional[_Iterable[int]] = ..., revokes: _Optional[_Iterable[int]] = ..., writes: _Optional[_Iterable[_Union[WriteOp, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[LoadOp, _Mapping]]] = ..., epoch: _Optional[int] = ..., hold_releases: _Optional[_Iterable[int]] = ...) -> None: ...

class OutcomeRequest(_message.Message):
    __slots__ = ("epoch", "step", "fence", "asking_rank")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    ASKING_RANK_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    fence: bool
    asking_rank: int
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., fence: _Optional[bool] = ..., asking_rank: _Optional[int] = ...) -> None: ...

class OutcomeReply(_message.Message):
    __slots__ = ("reply", "error")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reply: StepReply
    error: StepError
    def __init__(self, reply: _Optional[_Union[StepReply, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("status", "reason", "message", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    status: str
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PrefetchDecision(_message.Message):
    __slots__ = ("op_id", "outcome", "pages", "reason")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[PrefetchDecision.Outcome]
        HIT: _ClassVar[PrefetchDecision.Outcome]
        DONE: _ClassVar[PrefetchDecision.Outcome]
        REVOKED: _ClassVar[PrefetchDecision.Outcome]
    OUTCOME_UNSPECIFIED: PrefetchDecision.Outcome
    HIT: PrefetchDecision.Outcome
    DONE: PrefetchDecision.Outcome
    REVOKED: PrefetchDecision.Outcome
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    outcome: PrefetchDecision.Outcome
    pages: int
    reason: str
    def __init__(self, op_id: _Optional[int] = ..., outcome: _Optional[_Union[PrefetchDecision.Outcome, str]] = ..., pages: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class BackupDecision(_message.Message):
    __slots__ = ("op_id", "stored", "pages")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    stored: bool
    pages: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, op_id: _Optional[int] = ..., stored: _Optional[bool] = ..., pages: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LoadDecision(_message.Message):
    __slots__ = ("op_id", "pages")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    pages: int
    def __init__(self, op_id: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "round", "decisions", "state_digest", "prefetches", "write_acks", "backups", "loads", "write_failures", "load_failures", "epoch", "host_entered", "host_left", "host_entered_slots", "daemon_open")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    WRITE_ACKS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOST_ENTERED_FIELD_NUMBER: _ClassVar[int]
    HOST_LEFT_FIELD_NUMBER: _ClassVar[int]
    HOST_ENTERED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_OPEN_FIELD_NUMBER: _ClassVar[int]
    step: int
    round: int
    decisions: Decisions
    state_digest: int
    prefetches: _containers.RepeatedCompositeFieldContainer[PrefetchDecision]
    write_acks: _containers.RepeatedScalarFieldContainer[int]
    backups: _containers.RepeatedCompositeFieldContainer[BackupDecision]
    loads: _containers.RepeatedCompositeFieldContainer[LoadDecision]
    write_failures: _containers.RepeatedScalarFieldContainer[int]
    load_failures: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    host_entered: _containers.RepeatedScalarFieldContainer[bytes]
    host_left: _containers.RepeatedScalarFieldContainer[bytes]
    host_entered_slots: _containers.RepeatedScalarFieldContainer[int]
    daemon_open: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., decisions: _Optional[_Union[Decisions, _Mapping]] = ..., state_digest: _Optional[int] = ..., prefetches: _Optional[_Iterable[_Union[PrefetchDecision, _Mapping]]] = ..., write_acks: _Optional[_Iterable[int]] = ..., backups: _Optional[_Iterable[_Union[BackupDecision, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[LoadDecision, _Mapping]]] = ..., write_failures: _Optional[_Iterable[int]] = ..., load_failures: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., host_entered: _Optional[_Iterable[bytes]] = ..., host_left: _Optional[_Iterable[bytes]] = ..., host_entered_slots: _Optional[_Iterable[int]] = ..., daemon_open: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("rank", "world_size", "domain_ranks", "mode", "agreement_lag", "last_step", "rounds_completed", "open_questions", "state", "failure", "metrics_port", "attached", "epoch", "agreement_timeout_s", "version")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_RANKS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_LAG_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    OPEN_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    domain_ranks: _containers.RepeatedScalarFieldContainer[int]
    mode: str
    agreement_lag: int
    last_step: int
    rounds_completed: int
    open_questions: int
    state: str
    failure: str
    metrics_port: int
    attached: bool
    epoch: int
    agreement_timeout_s: float
    version: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., domain_ranks: _Optional[_Iterable[int]] = ..., mode: _Optional[str] = ..., agreement_lag: _Optional[int] = ..., last_step: _Optional[int] = ..., rounds_completed: _Optional[int] = ..., open_questions: _Optional[int] = ..., state: _Optional[str] = ..., failure: _Optional[str] = ..., metrics_port: _Optional[int] = ..., attached: _Optional[bool] = ..., epoch: _Optional[int] = ..., agreement_timeout_s: _Optional[float] = ..., version: _Optional[str] = ...) -> None: ...
