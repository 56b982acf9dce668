"""A step's reply on the wire names what each backup wrote, and the client
reads it back (`StepResult.backup_pages`): the storage tier's contents as
agreed, which the SGLang backend publishes as KV events."""

import numpy as np
import pytest

from cpcache.client.messages import step_result
from cpcache.daemon.wire import step_reply
from cpcache.rank.stepper import StepAnswer
from cpcache.state.intents import Decisions

pytestmark = pytest.mark.timeout(10)

A, B, C = (bytes([n]) * 32 for n in (1, 2, 3))


def test_a_backup_decision_names_its_pages_and_the_client_reads_them():
    decided = Decisions(backups=[(7, True), (9, False)], backup_pages=[(A, B), (C,)], host_left=[C])
    reply = step_reply(StepAnswer(5, 5, np.array([], dtype=np.int64), np.array([], dtype=np.int64), 3, decided))
    assert [(b.op_id, b.stored, list(b.pages)) for b in reply.backups] == [(7, True, [A, B]), (9, False, [C])]
    result = step_result(reply)
    assert result.backups == {7: True, 9: False}
    assert result.backup_pages == {7: (A, B), 9: (C,)}
    assert result.host_left == (C,)


def test_decisions_without_pages_make_backups_that_name_none():
    """As from decisions built before backups named their pages."""
    reply = step_reply(StepAnswer(1, 1, np.array([], dtype=np.int64), np.array([], dtype=np.int64), 0,
                                  Decisions(backups=[(4, True)])))
    assert step_result(reply).backup_pages == {4: ()}


def test_backup_pages_are_not_counted_as_decisions():
    assert Decisions(backups=[(1, True)], backup_pages=[(A, B)]).count() == 1
