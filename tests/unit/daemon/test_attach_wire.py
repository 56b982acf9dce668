"""What an Attach carries into the tenant: the model id, the geometry (its
KV dtype, and the parts of a page beside its KV) and the model's own dtype;
a request without the model dtype (a client from before the field) reads as
an empty one; a hostile part is a clear INVALID_ARGUMENT, found before any
work that grows with it."""

import pytest

from cpcache.client.messages import attach_request
from cpcache.daemon.wire import attach_from_wire
from cpcache.errors import InvalidArgument
from cpcache.geometry import KVGeometry, PagePart
from cpcache.v1 import daemon_pb2 as pb

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=16, dtype="bfloat16", page_size=16)


def test_the_model_dtype_travels_with_the_model_id():
    request = attach_request("tiny@default", GEOMETRY, 8, shm_ticket="t" * 32, model_dtype="float32")
    ask = attach_from_wire(pb.AttachRequest.FromString(request.SerializeToString()))
    assert (ask.model_id, ask.model_dtype, ask.geometry) == ("tiny@default", "float32", GEOMETRY)


def test_an_older_clients_attach_has_no_model_dtype():
    request = attach_request("tiny@default", GEOMETRY, 8, shm_ticket="t" * 32)
    assert not request.model_dtype
    # An older client's request is these bytes: field 10 never set.
    wire = request.SerializeToString()
    ask = attach_from_wire(pb.AttachRequest.FromString(wire))
    assert ask.model_dtype == ""


DSA = KVGeometry(layers=2, kv_kind="mla", heads=1, head_dim=32, dtype="bfloat16", page_size=16,
                 beside=(PagePart("indexer", rows_per_page=1, width=16 * 132, dtype="uint8"),))


def test_the_parts_beside_the_kv_travel_with_the_geometry():
    request = attach_request("dsa", DSA, 8, shm_ticket="t" * 32)
    ask = attach_from_wire(pb.AttachRequest.FromString(request.SerializeToString()))
    assert ask.geometry == DSA and ask.geometry.fingerprint() == DSA.fingerprint()


def hostile(**change) -> pb.AttachRequest:
    request = attach_request("dsa", DSA, 8, shm_ticket="t" * 32)
    for name, value in change.items():
        if name == "parts":
            del request.geometry.beside[:]
            request.geometry.beside.extend(value)
        else:
            setattr(request.geometry, name, value)
    return request


@pytest.mark.parametrize("request_, words", [
    (hostile(kv_kind="part"), "kv_kind must be one of mha, mla"),
    (hostile(parts=[pb.PagePart(name=f"p{i}", rows_per_page=1, width=8, dtype="uint8") for i in range(100_000)]),
     "100000 parts beside the KV; at most 8"),
    (hostile(parts=[pb.PagePart(name="x", rows_per_page=0, width=8, dtype="uint8")]), "rows_per_page"),
    (hostile(parts=[pb.PagePart(name="x", rows_per_page=1, width=1 << 31, dtype="uint8")]), "part 'x': a page of"),
    (hostile(parts=[pb.PagePart(name="x", rows_per_page=1, width=8, dtype="")]), "part 'x': dtype"),
    (hostile(parts=[pb.PagePart(name="a\nb" * 1000, rows_per_page=1, width=8, dtype="uint8")]), "1 to 32 of"),
    (hostile(parts=[pb.PagePart(name="kv", rows_per_page=1, width=8, dtype="uint8")]), "not 'kv'"),
    (hostile(parts=[pb.PagePart(name="x", rows_per_page=1, width=8, dtype="uint8")] * 2), "distinct"),
], ids=["part-kind", "too-many-parts", "zero-rows", "huge-page", "no-dtype", "forging-name", "kv-name",
        "duplicates"])
def test_a_hostile_part_is_a_clear_invalid_argument(request_, words):
    with pytest.raises(InvalidArgument, match=words):
        attach_from_wire(pb.AttachRequest.FromString(request_.SerializeToString()))


def test_a_client_refuses_a_daemon_that_took_only_the_kv_of_a_page_with_parts():
    """A daemon from before parts reads field 7 as unknown and attaches the KV alone."""
    from cpcache.client.calls import attached_whole as _attached_whole
    from cpcache.errors import FailedPrecondition

    assert _attached_whole(DSA, pb.AttachReply(page_bytes=DSA.page_bytes)).page_bytes == DSA.page_bytes
    with pytest.raises(FailedPrecondition, match="predates parts beside the KV"):
        _attached_whole(DSA, pb.AttachReply(page_bytes=DSA.parts[0].page_bytes))
