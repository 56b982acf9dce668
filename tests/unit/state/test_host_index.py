"""The host index's eviction: least recently used leaves first, all or
nothing when asked, and work bounded by what it looks at; and the pages a
write-back policy backs up first, least recently used first."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpcache.state.host_index import HostIndex


def page(n: int) -> bytes:
    return n.to_bytes(8, "big")


def chains(index: HostIndex, count: int, length: int, step: int = 0) -> list[list[bytes]]:
    made = []
    for c in range(count):
        pages = [page(100 * c + i) for i in range(length)]
        index.insert(pages, list(range(length * c, length * (c + 1))), None, step + c)
        made.append(pages)
    return made


def test_all_or_nothing_evicts_nothing_when_too_few_can_go_and_the_index_is_unchanged():
    index = HostIndex()
    a, b = chains(index, 2, 3)
    index.ref(b, +1)  # b is being read: only a's three pages can go
    assert index.evict(4, all_or_nothing=True) == []
    assert len(index) == 6 and all(p in index for p in a + b)
    index.take_changes()
    # Nothing was lost by the undo: the same eviction without the condition takes a whole, leaf first.
    assert [p for p, _ in index.evict(4)] == [a[2], a[1], a[0]]
    assert index.take_changes() == ([], sorted(a))


def test_eviction_order_is_least_recently_used_leaf_first_and_parents_follow_their_last_child():
    index = HostIndex()
    a, b = chains(index, 2, 2)  # a at step 0, b at step 1
    index.touch(a, step=5)
    assert [p for p, _ in index.evict(2, all_or_nothing=True)] == [b[1], b[0]]
    assert [p for p, _ in index.evict(1)] == [a[1]]


def test_a_touched_leaf_inside_a_list_stays_evictable():
    index = HostIndex()
    (a,) = chains(index, 1, 1)
    (b,) = chains(index, 1, 1, step=1)
    index.touch([a[0], b[0]], step=7)  # a is a leaf, not the list's last page
    assert {p for p, _ in index.evict(2)} == {a[0], b[0]}


def test_touching_again_and_again_keeps_the_heap_bounded_by_the_index():
    index = HostIndex()
    made = chains(index, 8, 4)
    for step in range(10, 10_000):
        index.touch(made[step % 8], step)
    assert len(index._leaves) <= 2 * len(index) + 64
    assert len(index.evict(32)) == 32


class ReferenceIndex:
    """The eviction rule stated plainly: repeatedly take, among the current
    unreferenced leaves that may go, the least recently used (ties by hash)."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes | None] = {}
        self.last_used: dict[bytes, int] = {}
        self.refs: dict[bytes, int] = {}
        self.backed_up: dict[bytes, bool] = {}

    def insert(self, pages: list[bytes], parent: bytes | None, step: int) -> None:
        for p in pages:
            self.parent[p], self.last_used[p], self.refs[p], self.backed_up[p] = parent, step, 0, False
            parent = p

    def evict(self, count: int, keep: set[bytes], all_or_nothing: bool) -> list[bytes]:
        gone: list[bytes] = []
        while len(gone) < count:
            parents = {self.parent[p] for p in self.parent if p not in gone}
            leaves = [(self.last_used[p], p) for p in self.parent
                      if p not in gone and p not in parents and not self.refs[p] and p not in keep]
            if not leaves:
                break
            gone.append(min(leaves)[1])
        if all_or_nothing and len(gone) < count:
            return []
        for p in gone:
            del self.parent[p], self.last_used[p], self.refs[p], self.backed_up[p]
        return gone

    def least_recent_unbacked(self, count: int) -> list[bytes]:
        return [p for _, p in sorted((self.last_used[p], p) for p in self.parent
                                     if not self.backed_up[p] and not self.refs[p])][:count]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_eviction_and_backup_candidates_agree_with_the_rules_stated_plainly(data):
    index, reference = HostIndex(track_unbacked=True), ReferenceIndex()
    next_page, step = 0, 0
    for _ in range(data.draw(st.integers(5, 40))):
        step += 1
        pages = sorted(reference.parent)
        action = data.draw(st.sampled_from(["insert", "insert", "touch", "ref", "evict", "mark", "unbacked"]))
        if action == "insert":
            length = data.draw(st.integers(1, 6))
            # Hashes out of order, so that ties by hash do not follow insertion.
            chain = [page((next_page + i) * 7919 % 10007) for i in range(length)]
            next_page += length
            parent = data.draw(st.sampled_from([None, *pages])) if pages else None
            index.insert(chain, list(range(len(chain))), parent, step)
            reference.insert(chain, parent, step)
        elif action == "touch" and pages:
            touched = data.draw(st.lists(st.sampled_from(pages), max_size=4, unique=True))
            index.touch(touched, step)
            for p in touched:
                reference.last_used[p] = step
        elif action == "ref" and pages:
            p, delta = data.draw(st.sampled_from(pages)), data.draw(st.sampled_from([1, -1]))
            if reference.refs[p] + delta >= 0:
                index.ref([p], delta)
                reference.refs[p] += delta
        elif action == "evict":
            count = data.draw(st.integers(1, 12))
            keep = set(data.draw(st.lists(st.sampled_from(pages), max_size=3))) if pages else set()
            all_or_nothing = data.draw(st.booleans())
            evicted = index.evict(count, lambda p, e, keep=keep: p in keep, all_or_nothing=all_or_nothing)
            assert [p for p, _ in evicted] == reference.evict(count, keep, all_or_nothing)
        elif action == "mark" and pages:
            marked, backed_up = data.draw(st.lists(st.sampled_from(pages), max_size=4)), data.draw(st.booleans())
            for p in marked:
                index.mark_backed_up(p, backed_up)
                reference.backed_up[p] = backed_up
        elif action == "unbacked":
            count = data.draw(st.integers(1, 12))
            assert index.least_recent_unbacked(count) == reference.least_recent_unbacked(count)
        assert sorted(p for p, _ in index.items()) == sorted(reference.parent)


def test_a_chain_whose_pages_enter_out_of_order_counts_its_children():
    """Each write is acknowledged on its own, so a page may enter before the
    page it follows: that parent enters with the child already counted, and
    is evicted only after it, whatever the recency."""
    index = HostIndex()
    index.insert([page(2)], [1], page(1), step=1)  # the child first
    index.insert([page(1)], [0], None, step=2)
    assert index[page(1)].children == 1
    index.touch([page(2)], step=3)  # the parent is now the least recent page, but not a leaf
    assert [p for p, _ in index.evict(1)] == [page(2)]
    assert index[page(1)].children == 0
    assert [p for p, _ in index.evict(1)] == [page(1)]
    assert len(index) == 0


def test_a_child_evicted_before_its_parent_entered_leaves_no_count_behind():
    index = HostIndex()
    index.insert([page(2)], [1], page(1), step=1)
    assert [p for p, _ in index.evict(1)] == [page(2)]
    index.insert([page(1)], [0], None, step=2)
    assert index[page(1)].children == 0
    assert [p for p, _ in index.evict(1)] == [page(1)]


def test_made_up_hashes_that_loop_pin_no_page():
    """A real chain never loops (a page's hash covers its parent's), but a
    scheduler may send hashes that do: each page of the loop would be the
    other's parent, and neither ever a leaf."""
    index = HostIndex()
    index.insert([page(1)], [0], page(2), step=1)  # 1 follows 2
    index.insert([page(2)], [1], page(1), step=2)  # and 2 follows 1
    assert sorted(p for p, _ in index.evict(2)) == [page(1), page(2)]
    index.insert([page(3)], [2], page(3), step=3)  # its own parent
    assert [p for p, _ in index.evict(1)] == [page(3)]
    assert len(index) == 0
