"""What an Attach carries into the tenant: the model id, the geometry (its
KV dtype) and the model's own dtype; a request without the model dtype (a
client from before the field) reads as an empty one."""

from cpcache.client.messages import attach_request
from cpcache.daemon.wire import attach_from_wire
from cpcache.geometry import KVGeometry
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
