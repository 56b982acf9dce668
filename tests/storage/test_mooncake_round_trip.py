"""Pages move bit-exact device -> host -> Mooncake Store -> host -> device,
for every host layout, MHA and MLA, on a real mooncake_master: the file
backend's round trip (tests/unit/dataplane/test_data_plane.py), run here
with the "mooncake" backend."""

import pytest

from tests.unit.dataplane import test_data_plane

pytestmark = pytest.mark.timeout(60)

test_round_trip_is_bit_exact = test_data_plane.test_round_trip_is_bit_exact  # the same test, collected here too


@pytest.fixture
def backend_kind(mooncake_master):
    return "mooncake"
