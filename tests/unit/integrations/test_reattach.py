"""When a rank fallen back to its device tree tries to attach again
(cpcache/integrations/sglang/reattach.py): on absolute iterations, multiples
of a wait that doubles with each failed try, kept by a skipped one; ranks
that fell back at different iterations try at the same ones."""

import pytest

from cpcache.errors import FailedPrecondition
from cpcache.integrations.sglang.reattach import LONGEST_WAIT, AttachAgain, NotServingYet


class Daemon:
    def __init__(self, answers, then=None):
        self.answers = list(answers)  # per try: an exception to raise, or the session to return
        self.then = then  # once they are spent

    def attach(self):
        answer = self.answers.pop(0) if self.answers else self.then
        if isinstance(answer, Exception):
            raise answer
        return answer


def tries(again: AttachAgain, until: int) -> list[int]:
    """Run iterations up to `until`: -> those a try fell on."""
    fell_on = []
    while again.iteration < until:
        again.iteration += 1
        if again.due():
            fell_on.append(again.iteration)
            if again.attempt() is not None:
                break
    return fell_on


def test_a_failed_try_doubles_the_wait_and_a_skipped_one_keeps_it():
    daemon = Daemon([FailedPrecondition("no"), NotServingYet("starting"), FailedPrecondition("no"), "session"])
    again = AttachAgain(0, daemon.attach, after=4)
    again.iteration = 5
    again.fell_back()
    assert again.next_try == 8
    assert tries(again, 100) == [8, 16, 24, 32]  # waits 4, then 8 (failed), 8 (skipped), 16 (failed): 32
    assert again.next_try is None and not again.due()


def test_ranks_that_fell_back_apart_try_at_the_same_iterations():
    """Each rank's tries fall on multiples of its own wait, so those of the
    rank whose wait is longer are tries of the other too; once both waits
    stop growing, they try together."""
    ranks = [AttachAgain(rank, Daemon([], then=FailedPrecondition("no")).attach, after=4) for rank in (0, 1)]
    ranks[0].iteration, ranks[1].iteration = 3, 13
    for again in ranks:
        again.fell_back()
    first, second = (tries(again, 2000) for again in ranks)
    assert first[:4] == [4, 8, 16, 32] and second[:4] == [16, 24, 32, 64]
    assert {32, 64, 128} <= set(first) & set(second)
    assert [t for t in first if t > 1000] == [t for t in second if t > 1000] != []


def test_the_wait_stops_growing_and_without_a_way_back_no_try_is_due():
    again = AttachAgain(0, Daemon([], then=FailedPrecondition("no")).attach, after=1)
    again.fell_back()
    tries(again, 10_000)
    assert again.next_try - again.iteration <= LONGEST_WAIT
    never = AttachAgain(0, None, after=4)
    never.fell_back()
    assert not never.possible and never.next_try is None and not never.due()


def test_this_sides_os_error_counts_as_a_failed_try(caplog):
    again = AttachAgain(2, Daemon([OSError("no memfd")]).attach, after=4)
    again.fell_back()
    again.iteration = 4
    assert again.due() and again.attempt() is None
    assert again.next_try == 8 and "rank 2 could not attach again at iteration 4" in caplog.text


@pytest.mark.parametrize("skips, logged", [(1, 1), (2, 2), (3, 2), (4, 3)])
def test_skips_are_logged_ever_more_rarely(caplog, skips, logged):
    import logging

    caplog.set_level(logging.INFO)
    again = AttachAgain(0, Daemon([NotServingYet("starting")] * skips).attach, after=1)
    again.fell_back()
    for _ in range(skips):
        again.iteration = again.next_try
        again.attempt()
    assert caplog.text.count("skipped attaching again") == logged
