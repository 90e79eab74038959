"""What a worker holds, as events: vLLM 0.32's KV-event format, and how it travels.

Workers publish, routers subscribe, so a router knows each worker's prefix cache and retained
conversations without asking on a request's path (router/kv_index.py). The messages are vLLM's own
(vllm/distributed/kv_events.py: an array-like `EventBatch(ts, events, data_parallel_rank)` of tagged
`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, msgspec-msgpack), the same fields in the same
order, so a consumer of vLLM's events reads ours and one router index reads both:
- a prefix-cache block stored: `BlockStored` with its chain hash, its parent's, and its token ids
  (a router indexes by tokens: it needs no worker's hash function or seed); `medium` is the device;
- removed (evicted): `BlockRemoved`; a restarted worker's first batch starts with `AllBlocksCleared`;
- a decode worker's retained turn (bidirectional reuse): `BlockStored` with `medium` "RETAINED", its
  retention id in `ownership` and the client's session id in `session_id`; stored again when it is
  kept again (refreshed), `BlockRemoved` with the same `ownership` when it expires or is evicted.
- an empty batch under the last batch's number when nothing happened for HEARTBEAT_S: the publisher
  is alive (a subscriber that missed that batch sees its gap).

Transport, as vLLM's `ZmqEventPublisher`: a PUB socket sends `[topic, seq (8 bytes big-endian),
payload]`, one sequence per publisher from 0; a ROUTER socket answers a replay request (`[b"", seq]`
from a DEALER) with every buffered batch from that seq on, then `[b"", END_SEQ, b""]`. Where its
buffer no longer reaches back that far (a router that joined late, a long gap), it answers with one
snapshot batch instead: `AllBlocksCleared` then everything held, numbered with the last seq it
published (the state after that batch). Both sockets are ZMQ CURVE servers whose keys derive from
the deployment secret (`curve_keys`): only a holder of the secret can subscribe, and the events
(they carry prompt tokens) are encrypted on the wire.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgspec
import zmq
import zmq.utils.z85

MEDIUM_RETAINED = "RETAINED"       # a decode worker's retained conversation (ours; vLLM's are GPU, CPU, STORAGE)
HASH_SCHEME = "blake2b-128-chain"  # what our workers' block_hashes are (engine/block_pool.block_hash)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HEARTBEAT_S = 0.5                  # an empty batch at least this often: silence longer than STALE_S means trouble
STALE_S = 3.0
CURVE_LABEL = b"kvhandoff-kv-events-v1"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (the tag is the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(KVEventBatch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of every publisher of the deployment: derived from its secret, so
    that subscribers need nothing more than the secret they already have."""
    secret_key = zmq.utils.z85.encode(hmac.new(secret, CURVE_LABEL, hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


def secure_server(sock: zmq.Socket, secret: bytes) -> None:
    sock.curve_secretkey = curve_keys(secret)[1]
    sock.curve_server = True


def secure_client(sock: zmq.Socket, secret: bytes) -> None:
    sock.curve_serverkey = curve_keys(secret)[0]
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()


class Health(msgspec.Struct, omit_defaults=True):
    """What a worker's /health says of its events (`kv_events`): where to subscribe (ports on the
    worker's own host), how its hashes are made, its block size and its retention ttl."""
    host: str
    port: int
    replay_port: int
    block_size: int
    hash_scheme: str = HASH_SCHEME
    retention_ttl_s: float | None = None
    tokenizer: str = ""               # a fingerprint of its tokenizer files (routers fetch /kv/tokenizer once per)
