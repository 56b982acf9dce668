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
    __slots__ = ("step", "votes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    votes: Votes
    def __init__(self, step: _Optional[int] = ..., votes: _Optional[_Union[Votes, _Mapping]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "round", "decisions", "state_digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    round: int
    decisions: Decisions
    state_digest: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., decisions: _Optional[_Union[Decisions, _Mapping]] = ..., state_digest: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("rank", "world_size", "domain_ranks", "mode", "agreement_lag", "last_step", "rounds_completed", "open_questions", "state", "failure")
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
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., domain_ranks: _Optional[_Iterable[int]] = ..., mode: _Optional[str] = ..., agreement_lag: _Optional[int] = ..., last_step: _Optional[int] = ..., rounds_completed: _Optional[int] = ..., open_questions: _Optional[int] = ..., state: _Optional[str] = ..., failure: _Optional[str] = ...) -> None: ...
