"""What a round that failed on this rank means, decided on the agreement
thread: the peers that are missing (the epoch ends), or the round as a peer
completed it, asked of the peers through the witness (applied here as there).
The agreement engine calls it through `Formation` (`rank/epochs.py`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch.distributed import TCPStore

from cpcache.agreement.collective import Rendezvous
from cpcache.agreement.engine import Recovered, peer_lost
from cpcache.agreement.liveness import CONNECT_S, diagnose, heartbeat_key
from cpcache.agreement.witness import RoundWitness
from cpcache.config import WITNESS_WAIT_S, DaemonConfig
from cpcache.errors import PeerLost


def diagnose_round(rdzv: Rendezvous, config: DaemonConfig, ranks: Sequence[int], store: TCPStore | None,
                   witness: RoundWitness | None, round_number: int, exc: BaseException) -> PeerLost | Recovered:
    """On the agreement thread, round `round_number` of the epoch `rdzv`
    having failed here: the peers among `ranks` (the domain's) that are
    missing, or the round as a peer completed it (it asks its peers through
    the witness, for up to WITNESS_WAIT_S)."""
    peers = tuple(r for r in ranks if r != config.rank)
    window = max(0.3, 3 * config.heartbeat_interval_s)
    diagnosis = diagnose(rdzv, peers, round_number, window, store)
    failure = peer_lost(round_number, exc, diagnosis)
    if witness is None:
        return failure
    # Bounded well within a client's deadline margin past the round's
    # timeout: a peer that completed the round publishes within a few
    # heartbeats of the ask, and one still in it completes it nowhere.
    wait_s = min(config.agreement_timeout_s, WITNESS_WAIT_S)
    told = witness.recover(store, functools.partial(rdzv.connect, CONNECT_S), round_number,
                           {r: heartbeat_key(rdzv, r) for r in diagnosis.stalled}, wait_s,
                           config.heartbeat_interval_s, window)
    if told is None:
        return failure
    rank, vector = told
    return Recovered(rank, vector, PeerLost(
        f"round {round_number} failed on rank {config.rank} ({str(exc).splitlines()[0][:200]}) after rank "
        f"{rank} completed it: applied here as there, and epoch {rdzv.epoch} ends (no later round of it "
        f"can complete)", ()))
