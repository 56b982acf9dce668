"""The exhaustive small-scope check of Attach (docs/design.md rule 11), and the
defects it finds when reintroduced."""

import time

import pytest

from cpcache.agreement import attach

from .attach_model import check_scope

pytestmark = pytest.mark.timeout(600)


def test_attach_holds_its_invariants_in_every_order_of_a_small_scope(capsys):
    started = time.perf_counter()
    two = check_scope(ranks=2, calls=2)
    three = check_scope(ranks=3, calls=1)
    with capsys.disabled():
        print(f"\nattach model: 2 ranks x up to 2 attaches: {two[0]} programs, {two[1]} states, {two[2]} transitions;"
              f" 3 ranks x up to 1: {three[0]} programs, {three[1]} states, {three[2]} transitions; "
              f"{time.perf_counter() - started:.1f}s")


def test_attach_holds_when_the_store_restarts_anywhere(capsys):
    """The store forgets every key at any point (once): a rank that read the
    decision confirms it in a round; none attaches unless all read the same."""
    started = time.perf_counter()
    two = check_scope(ranks=2, calls=2, restarts=1)
    three = check_scope(ranks=3, calls=1, restarts=1)
    with capsys.disabled():
        print(f"\nattach model with a store restart: 2 ranks x up to 2 attaches: {two[1]} states, {two[2]} "
              f"transitions; 3 ranks x up to 1: {three[1]} states, {three[2]} transitions; "
              f"{time.perf_counter() - started:.1f}s")


def test_it_finds_a_split_when_the_stores_decision_is_trusted_across_a_restart():
    """The decision lives only in the store; a restarted store
    forgets it, one rank has read "attached", its peer decides "missing"."""
    with pytest.raises(AssertionError, match="split"):
        check_scope(ranks=2, calls=1, restarts=1, confirm=False)


def test_it_finds_a_stale_descriptor_when_descriptors_outlive_their_attempt(monkeypatch):
    """One key per rank, replaced by each attach, never withdrawn
    after a refusal: a peer's refused descriptor matches a later attach."""
    monkeypatch.setattr(attach, "_published", lambda namespace, attempt, rank: f"{namespace}/attach/rank{rank}")
    monkeypatch.setattr(attach.Attempt, "publish", lambda self: self.store.set(
        attach._published(self.namespace, self.attempt, self.rank), attach.json.dumps(self.descriptor,
                                                                                      sort_keys=True)))
    with pytest.raises(AssertionError, match="not the whole domain"):
        check_scope(ranks=2, calls=2, confirm=False)  # the store's protocol alone
    # The confirmation round catches the two attempts meeting (nothing is
    # attached), but attaching again never converges.
    with pytest.raises(AssertionError, match="did not converge"):
        check_scope(ranks=2, calls=2)


def test_it_finds_a_split_when_a_deadline_decides_locally(monkeypatch):
    """A rank whose deadline passes fails on its own, without the
    attempt's one decision; a peer publishing meanwhile is told attached."""
    look = attach.Attempt.look

    def local_deadline(self, expired):
        decision = look(self, False)
        if decision is None and expired:
            return {"outcome": attach.MISSING, "ranks": []}
        return decision

    monkeypatch.setattr(attach.Attempt, "look", local_deadline)
    with pytest.raises(AssertionError, match="split"):
        check_scope(ranks=2, calls=2)
