"""The overlapped load-back over real daemons: a load opened by its round
publishes this rank's copy layer by layer on the scheduler's board, the
pages land bit-exact, a copy that fails at a layer says so on the board
(and the load is agreed failed), and a bad slot is refused."""

import threading
import time

import pytest
import torch

from cpcache.client import Client, LoadRequest, SchedulerSession
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.errors import CacheError, InvalidArgument
from cpcache.geometry import KVGeometry
from cpcache.keys import chain
from cpcache.load_signals import FAILED, LoadSignals
from cpcache.topology import Topology

pytestmark = pytest.mark.timeout(90)

LAYERS = 4
GEOMETRY = KVGeometry(layers=LAYERS, kv_kind="mha", heads=2, head_dim=16, dtype="float16", page_size=4)
DEVICE_PAGES = 16


def _written(session: SchedulerSession, pages: list[bytes], device_pages: list[int]) -> None:
    acked: list[bool] = []
    session.write_through(pages, device_pages, done=acked.append)
    for _ in range(200):
        session.flush()
        if acked:
            break
    assert acked == [True]


def _settled(session: SchedulerSession) -> None:
    for _ in range(200):
        if not session.busy():
            return
        session.flush()
    raise AssertionError("the session never settled")


async def test_a_load_publishes_its_layers_as_they_land_and_lands_bit_exact(run_dir):
    spec = DomainSpec(Topology(tp=2), run_dir, extra=dict(host_pool_pages=16),
                      per_rank={1: dict(fault_copy_layer_delay_ms=40)})  # rank 1 copies slowly, layer by layer
    async with LocalDomain(spec) as domain:
        pools = [DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES) for _ in range(2)]
        boards = [LoadSignals.create(4) for _ in range(2)]
        clients = [Client(socket, timeout_s=20) for socket in domain.sockets]
        try:
            seed = _attach_all(clients, pools, boards)
            for pool in pools:
                pool.tensor.view(torch.int16).random_()
            pages = [bytes.fromhex(h) for h in chain(list(range(12)), 4, seed)]
            sessions = [SchedulerSession(client) for client in clients]
            # Every rank writes pages 0-2 through, in one step per iteration.
            for session in sessions:
                session.write_through(pages, [0, 1, 2])
            _step_all(sessions)
            while any(s.busy() for s in sessions):
                _step_all(sessions)
            expected = [pool.tensor[:, :, : 3 * 4].view(torch.int16).clone() for pool in pools]

            # The load: opened by one round on both ranks, then read as it lands.
            opened = _open_all(sessions, pages, [9, 10, 11], boards)
            (op0, slot0), (op1, slot1) = opened
            assert boards[0].wait(slot0, op0, LAYERS, time.monotonic() + 10)
            seen = []
            deadline = time.monotonic() + 20
            while (progress := boards[1].progress(slot1, op1)) < LAYERS:
                if not seen or seen[-1] != progress:
                    seen.append(progress)
                assert time.monotonic() < deadline
            assert seen[0] < LAYERS and seen == sorted(seen)  # rank 1's layers came one by one
            for pool, before in zip(pools, expected):
                assert torch.equal(pool.tensor[:, :, 9 * 4 : 12 * 4].view(torch.int16), before)
            while any(s.busy() for s in sessions):
                _step_all(sessions)
            assert all(s.tally.load_acks == 1 for s in sessions)
            assert boards[0].in_use() == boards[1].in_use() == 0  # given back once decided
        finally:
            for client in clients:
                client.close()


async def test_a_copy_failing_at_a_layer_is_published_and_the_load_is_agreed_failed(run_dir):
    spec = DomainSpec(Topology(tp=2), run_dir, extra=dict(host_pool_pages=16),
                      per_rank={1: dict(fault_load_fail_layer=2)})
    async with LocalDomain(spec) as domain:
        pools = [DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES) for _ in range(2)]
        boards = [LoadSignals.create(4) for _ in range(2)]
        clients = [Client(socket, timeout_s=20) for socket in domain.sockets]
        try:
            seed = _attach_all(clients, pools, boards)
            pages = [bytes.fromhex(h) for h in chain(list(range(8)), 4, seed)]
            sessions = [SchedulerSession(client) for client in clients]
            for session in sessions:
                session.write_through(pages, [0, 1])
            while True:
                _step_all(sessions)
                if not any(s.busy() for s in sessions):
                    break
            ended: list[list[bool]] = [[], []]
            opened = _open_all(sessions, pages, [5, 6], boards, ended)
            if all(o is not None for o in opened):
                (op0, slot0), (op1, slot1) = opened
                assert not boards[1].wait(slot1, op1, LAYERS, time.monotonic() + 10)  # failed: said on the board
                assert boards[1].progress(slot1, op1) == FAILED
                assert boards[0].wait(slot0, op0, LAYERS, time.monotonic() + 10)  # rank 0's own copy landed
                while any(s.busy() for s in sessions):
                    _step_all(sessions)
                assert ended == [[False], [False]]  # agreed failed on both ranks
            else:
                assert opened == [None, None]  # failed in its opening round already: alike
            assert all(s.tally.load_failures == 1 for s in sessions)
        finally:
            for client in clients:
                client.close()


async def test_a_signal_slot_outside_the_board_or_without_one_is_refused(run_dir):
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=8))) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
        board = LoadSignals.create(2)
        with Client(domain.sockets[0], timeout_s=20) as client:
            seed = client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, load_signals=board).key_seed
            pages = [bytes.fromhex(h) for h in chain(list(range(4)), 4, seed)]
            session = SchedulerSession(client)
            _written(session, pages, [0])
            session._unsent.loads.append(LoadRequest(99, tuple(pages), (3,), 3))  # slot 3 of a board of 2
            with pytest.raises(InvalidArgument, match="signal slot 3 is outside"):
                session.flush()
            assert client.status().state  # still serving
        without = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
        with Client(domain.sockets[0], timeout_s=20) as client:
            seed = client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=without.fd).key_seed
            session = SchedulerSession(client, first_step=client.status().last_step + 1)
            session._unsent.loads.append(LoadRequest(7, tuple(pages), (3,), 1))
            with pytest.raises(InvalidArgument, match=r"\(0 slots\)"):
                session.flush()


def _attach_all(clients, pools, boards) -> str:
    """Attach is agreed: every rank attaches at once. -> the key seed."""
    return _together([lambda c=c, p=p, b=b: c.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=p.fd, load_signals=b)
                      for c, p, b in zip(clients, pools, boards)])[0].key_seed


def _together(calls: list) -> list:
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _step_all(sessions: list[SchedulerSession]) -> None:
    """One iteration on every rank: each sends its step, then each takes its reply."""
    for session in sessions:
        session.iterate()


def _open_all(sessions, pages, device_pages, boards, ended=None):
    """Every rank opens the same load: each sends its step before any waits
    for the reply (the round needs every rank's step)."""
    return _together([lambda i=i: sessions[i].load_opened(pages, device_pages, boards[i],
                                                           done=ended[i].append if ended is not None else None)
                      for i in range(len(sessions))])


async def test_an_attach_again_with_a_new_board_is_not_taken_for_a_retry(run_dir):
    """The same pool attached again, no step since (what a scheduler does
    when its attach succeeded but it did not hear so), with a fresh board:
    the daemon publishes on the new board, never on the old one."""
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=8))) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
        old, new = LoadSignals.create(2), LoadSignals.create(2)
        with Client(domain.sockets[0], timeout_s=20) as client:
            client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, load_signals=old)
            seed = client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, load_signals=new).key_seed
            pages = [bytes.fromhex(h) for h in chain(list(range(4)), 4, seed)]
            session = SchedulerSession(client, first_step=client.status().last_step + 1)
            _written(session, pages, [0])
            opened = session.load_opened(pages, [5], new)
            assert opened is not None
            op, slot = opened
            assert new.wait(slot, op, LAYERS, time.monotonic() + 10)
            _settled(session)
            assert session.tally.load_acks == 1


async def test_an_attach_names_the_step_its_session_comes_after(run_dir):
    """A scheduler attaching again takes its first step from the Attach's
    reply: nothing between an agreed Attach and its session's first step
    is a call to the daemon that could fail on one rank alone."""
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=8))) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
        with Client(domain.sockets[0], timeout_s=20) as client:
            first = client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, load_signals=LoadSignals.create(2))
            assert first.last_step == client.status().last_step
            session = SchedulerSession(client, first_step=first.last_step + 1)
            pages = [bytes.fromhex(h) for h in chain(list(range(4)), 4, first.key_seed)]
            _written(session, pages, [0])
            _settled(session)
            assert client.status().last_step > first.last_step
            again = client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, load_signals=LoadSignals.create(2))
            assert again.last_step == client.status().last_step
            session = SchedulerSession(client, first_step=again.last_step + 1)
            _written(session, [bytes.fromhex(h) for h in chain(list(range(8)), 4, again.key_seed)][1:], [1])
            assert client.status().last_step > again.last_step  # the new session's steps were taken


async def test_boards_of_different_sizes_on_two_ranks_are_refused_alike(run_dir):
    """Whether loads are overlapped, and how many at once, shapes every
    rank's steps: part of what an Attach agrees on."""
    async with LocalDomain(DomainSpec(Topology(tp=2), run_dir, extra=dict(host_pool_pages=8))) as domain:
        pools = [DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES) for _ in range(2)]
        boards = [LoadSignals.create(2), LoadSignals.create(4)]
        clients = [Client(socket, timeout_s=20) for socket in domain.sockets]
        try:
            outcomes = _together([lambda c=c, p=p, b=b: _outcome(lambda: c.attach("m", GEOMETRY, DEVICE_PAGES,
                                                                                  pool_fd=p.fd, load_signals=b))
                                  for c, p, b in zip(clients, pools, boards)])
            assert all(isinstance(o, CacheError) for o in outcomes), outcomes
            assert any("load_signal_slots" in str(o) for o in outcomes), outcomes
        finally:
            for client in clients:
                client.close()


def _outcome(call):
    try:
        return call()
    except CacheError as exc:
        return exc
