"""`domain` and `grid` reductions give identical answers on identical inputs,
over real gloo groups (one thread per rank in this process)."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cpcache.agreement.collective import Rendezvous, build_reducer, host_store
from cpcache.topology import Topology


def reduce_everywhere(topology, mode, vectors, store_port, deployment):
    rdzv = Rendezvous("127.0.0.1", store_port, deployment, timeout_s=30)

    def run(rank):
        reducer = build_reducer(rdzv.connect(), rdzv, topology, rank, mode, timeout_s=30)
        try:
            out = []
            for vector in vectors[rank]:
                v = vector.copy()
                reducer.min_inplace(v)
                out.append(v)
            return out
        finally:
            reducer.close()

    with ThreadPoolExecutor(topology.world_size) as pool:
        return list(pool.map(run, range(topology.world_size)))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sizes", [dict(tp=4, cp=2), dict(tp=4, dp=2), dict(tp=4, pp=2, cp=2)], ids=str)
def test_domain_and_grid_modes_agree(sizes):
    topology = Topology(**sizes)
    rng = np.random.default_rng(7)
    vectors = [[rng.integers(-(2**62), 2**62, size=n) for n in (1, 9, 300)] for _ in range(topology.world_size)]
    store = host_store()
    by_mode = {
        mode: reduce_everywhere(topology, mode, vectors, store.port, f"modes-{mode}") for mode in ("domain", "grid")
    }
    for rank in range(topology.world_size):
        domain = topology.domain(rank).ranks
        for i in range(3):
            expected = np.minimum.reduce([vectors[r][i] for r in domain])
            assert (by_mode["domain"][rank][i] == expected).all()
            assert (by_mode["grid"][rank][i] == expected).all()
