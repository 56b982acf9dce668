"""A KV event subscriber as a gateway runs one, in SGLang's environment: it
subscribes to a server's `--kv-events-config` ZMQ publisher, decodes each
batch with SGLang's own `KVEventBatch`, asks the publisher's replay socket
for any batch it missed (those sent before its subscription took), and
prints one JSON line per event, in sequence order:

    event {"seq": 3, "type": "BlockStored", "medium": "CPU_PINNED", "hashes": [...], "parent": ..., "tokens": 32}

Used by test_kv_events_server.py. Runs until killed."""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def emit(seq: int, payload: bytes, decoder: msgspec.msgpack.Decoder) -> None:
    batch = decoder.decode(payload)
    for event in batch.events:
        line: dict = {"seq": seq, "type": type(event).__name__, "dp_rank": batch.attn_dp_rank}
        if isinstance(event, BlockStored):
            line.update(medium=str(event.medium), hashes=list(event.block_hashes), parent=event.parent_block_hash,
                        tokens=len(event.token_ids), block_size=event.block_size)
        elif isinstance(event, BlockRemoved):
            line.update(medium=str(event.medium), hashes=list(event.block_hashes))
        else:
            assert isinstance(event, AllBlocksCleared), event
        print("event " + json.dumps(line), flush=True)


def main() -> None:
    endpoint, replay_endpoint = sys.argv[1], sys.argv[2]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    print("subscribed", flush=True)
    expected = 0
    while True:
        _topic, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq > expected:  # missed: ask the publisher's buffer, in order
            replay.send_multipart((b"", expected.to_bytes(8, "big")))
            while True:
                _, _topic, old_seq, old_payload = replay.recv_multipart()
                if old_seq == END_SEQ:
                    break
                number = int.from_bytes(old_seq, "big")
                if expected <= number < seq:
                    emit(number, old_payload, decoder)
                    expected = number + 1
            print(f"replayed up to {seq}", flush=True)
        if seq >= expected:
            emit(seq, payload, decoder)
            expected = seq + 1


if __name__ == "__main__":
    main()
