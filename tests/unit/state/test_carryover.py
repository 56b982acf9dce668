"""What a re-formed domain keeps of its host tier: the same pages on every
rank, whole chains only, whatever each rank offered."""

import pytest

from cpcache.state.allocator import PageAllocator
from cpcache.state.carryover import KeptPage, common, decode, encode, offer, restore
from cpcache.state.host_index import HostIndex

pytestmark = pytest.mark.timeout(30)


def page(n: int) -> bytes:
    return n.to_bytes(32, "big")


def chain(first: int, n: int, slot0: int) -> list[KeptPage]:
    return [KeptPage(page(first + i), page(first + i - 1) if i else None, slot0 + i, i % 2 == 0) for i in range(n)]


def test_offers_round_trip_through_bytes():
    pages = chain(10, 5, 3)
    offer = decode(encode(pages, [7, 9]))
    assert offer.pages == pages and offer.busy == [7, 9]
    assert decode(b"").pages == [] and decode(encode([])).busy == []


def test_every_rank_keeps_the_same_pages_whatever_order_it_reads_the_offers():
    a = chain(10, 5, 0) + chain(100, 3, 5)
    b = chain(10, 4, 0) + chain(100, 3, 5)  # one page short: applied a round less
    c = chain(10, 5, 0)[:2] + [KeptPage(page(12), page(11), 9, True)] + chain(100, 3, 5)  # page 12 in another slot
    kept = common([a, b, c])
    assert [k.page for k in kept] == [page(10), page(100), page(11), page(101), page(102)]
    assert common([c, a, b]) == common([b, c, a]) == kept


def test_a_chain_cut_in_the_middle_keeps_only_its_head():
    a = chain(10, 4, 0)
    b = [k for k in chain(10, 4, 0) if k.page != page(11)]  # b lost page 11 but kept 12 and 13
    assert [k.page for k in common([a, b])] == [page(10)]


def test_a_restarted_rank_offers_nothing_and_the_domain_keeps_nothing():
    assert common([chain(10, 4, 0), []]) == []


def test_restore_rebuilds_index_and_allocator():
    index, allocator = HostIndex(), PageAllocator(8)
    kept = common([chain(10, 3, 2), chain(10, 3, 2)])
    restore(kept, index, allocator)
    assert index.prefix([page(10), page(11), page(12)]) == 3 and allocator.free_count == 5
    assert allocator.allocate(5) == [0, 1, 5, 6, 7]
    assert offer(index) == sorted(kept, key=lambda k: k.page)
    evicted = index.evict(3)
    assert [p for p, _ in evicted] == [page(12), page(11), page(10)]  # leaves first, the chain unwinds
