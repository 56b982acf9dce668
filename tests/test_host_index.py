"""The host index's eviction: least recently used leaves first, all or
nothing when asked, and work bounded by what it looks at."""

from __future__ import annotations

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
