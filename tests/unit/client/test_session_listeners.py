"""A session's reply listeners (the SGLang backend's KV events of the host
pool and storage follow them): each agreed reply, once the session followed
it, in order; and the event medium each storage backend has."""

from __future__ import annotations

import pytest

from cpcache.client.messages import StepResult
from cpcache.client.session import SchedulerSession
from cpcache.integrations.sglang.tier_events import storage_medium

pytestmark = pytest.mark.timeout(10)

PAGE = bytes([1]) * 32


def test_listeners_hear_every_reply_after_the_session_followed_it():
    session = SchedulerSession()
    heard: list[tuple[int, int]] = []
    session.listeners.append(lambda reply: heard.append((reply.step, len(session.host))))
    op = session.write_through([PAGE], [0])
    step, _ = session.next_step()
    session.follow(StepResult(step, step, {}, 0, b"", write_acks=(op,), host_entered=(PAGE,)))
    step, _ = session.next_step()
    session.follow(StepResult(step, step, {}, 0, b"", host_left=(PAGE,)))
    assert heard == [(1, 1), (2, 0)]  # the host mirror had moved when each was heard


@pytest.mark.parametrize(("storage", "medium"), [
    ("file", "DISK"), ("mooncake", "EXTERNAL"), ("another-store", "EXTERNAL"), ("none", None), ("", None)])
def test_each_storage_backend_has_its_medium(storage, medium):
    assert storage_medium(storage) == medium
