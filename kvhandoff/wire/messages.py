"""The wire contract between router, prefill workers and decode workers (docs/HANDOFF.md), versioned.

One msgspec Struct per message and direction. Every message that arrives goes through `parse`,
which checks types strictly (a bool is not an int, a string is not a number) and turns anything
malformed into a MessageError naming the field, which the HTTP side answers with 400. A peer of
another protocol version is refused where it first shows: the transfer agents' handshake (the agent
is created with PROTOCOL as its protocol name) and `kv_transfer_params`.

Notifications between transfer agents are a tagged union (`kind`); `decode_notification` returns
the right Struct, and receivers dispatch on its type.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Literal, Union

import msgspec

from kvhandoff.wire.modes import ROLES, Mode, Role

# 1: untyped dicts, before this module (no version field). 3: the KV block's inner layout became
# [layers, K/V, kv_heads, block_size, head_dim] (issue 12): same bytes per block, other meaning, so
# a peer of version 2 must be refused rather than decode from K/V it misreads. 4: late-bound push
# (issue 13): a registration names its binding, /kv/rebind moves a handoff, Withdrawn tells the
# decode worker it was moved away from. 5: the first token goes to the client from the prefill (issue
# 24): a prefill answers a stream (FirstToken, then its handoff object), decode streams carry
# EventNotes, and a decode worker can serve a request colocated or resume one (ColocatedParams).
# 6: a bf16 block keeps each head's K and V in the paired layouts (model/paired_kv.py, issue 25):
# same bytes, other meaning again. 7: the pool is layer-major (a block is a range per layer, placed by
# the pool's size), so the messages that name a worker's blocks carry its pool's size (pool_blocks);
# a block's checksum is CRC-32C, over its layers in order. 8: a push registration travels between the
# agents (a notification), no longer as an HTTP request (issue 46).
PROTOCOL_VERSION = 8
PROTOCOL = f"kvhandoff-handoff/{PROTOCOL_VERSION}"     # the transfer agents' handshake compares it
# Per-request phases every handoff object reports, in ms (docs/HANDOFF.md): the one definition.
PHASES = ("prefill_queue", "prefill_compute", "handoff_wait", "transfer", "decode_queue", "first_step")
Phases = dict[str, Union[float, None]]


class MessageError(ValueError):
    """A message that does not follow the contract; `str()` says which field and why."""


class Message(msgspec.Struct, omit_defaults=True):
    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


def parse(cls: type, data, what: str):
    """`data` (JSON bytes or already-decoded builtins) as a `cls`, or MessageError naming `what`."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview, str)):
            return msgspec.json.decode(data, type=cls)
        return msgspec.convert(data, cls)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MessageError(f"{what}: {exc}") from None


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.json.encode(message)


def ms(seconds: float) -> float:
    """A duration as the milliseconds of a `phases_ms` entry."""
    return round(seconds * 1000, 3)


def prompt_hash(prompt_token_ids: list[int]) -> str:
    """What a push registration names its prompt by: the prefill checks it before the WRITE."""
    return hashlib.blake2b(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids), digest_size=16).hexdigest()


def check_version(version: int, what: str) -> None:
    if version != PROTOCOL_VERSION:
        raise MessageError(f"{what} speaks handoff protocol version {version}; this worker speaks "
                           f"{PROTOCOL_VERSION}: run the same kvhandoff version on every process of a deployment")


# ---------------------------------------------------------------------------------------------------
# Router -> worker: `kv_transfer_params` in the OpenAI body, one Struct per mode family and role.

class ReuseCandidate(Message):
    """Bidirectional: where the router believes the conversation's history is kept."""
    decode_url: str
    retention_id: str
    block_hashes: list[str]
    num_tokens: int = 0
    expires_in_s: float | None = None


class PullHandoff(Message):
    """A pull prefill's answer: where the prompt's KV is pinned, under a lease. The router passes it
    to the decode worker unchanged, as `remote`. (No version of its own: the decode worker checks the
    router's, and its agent's handshake with the prefill's checks theirs.)"""
    prompt_token_ids: list[int]
    num_kv_tokens: int                  # the whole prompt
    block_ids: list[int]
    pool_blocks: int                    # how many blocks the prefill's pool holds (where its ids lie: kv_layout.py)
    checksums: list[int]                # CRC-32C per block (kv_layout.block_checksums)
    agent_metadata: str                 # base64 of the prefill agent's metadata
    first_token_id: int | None = None   # sampled by the prefill (checked by the decode side: 400 if missing)
    handoff_id: str = ""
    prefill_worker: str = ""
    lease_ms: float = 0.0
    phases_ms: Phases = {}
    reused_tokens: int = 0
    reverse_bytes: int = 0
    reuse_decision: dict | None = None
    prefill_cached_tokens: int = 0      # of the prompt, served by the prefill worker's own prefix cache


class _Params(Message, kw_only=True):
    handoff_id: str
    mode: Mode
    role: Role
    protocol_version: int
    created: int | None = None          # the `created` of every chunk the client gets (the router's clock)


class PullPrefillParams(_Params):
    reuse: ReuseCandidate | None = None


class PushPrefillParams(_Params):
    decode_url: str | None = None       # informational: the registration names the destination
    reuse: ReuseCandidate | None = None


class PullDecodeParams(_Params):
    remote: PullHandoff
    retain: bool = False                # bidirectional: keep this turn's KV when it finishes
    supersedes: str | None = None       # ... replacing this retained turn
    session: str | None = None          # ... under the client's session id (any router finds it by it)


class PushDecodeParams(_Params):
    prefill_url: str
    binding: int = 0                    # late-bound push: which destination of the handoff this is (Rebind)
    retain: bool = False
    supersedes: str | None = None
    session: str | None = None


class ColocatedParams(_Params):
    """Router -> decode worker: compute this request here, with no handoff (selective
    disaggregation, a failed prefill retried colocated), or continue one another decode worker
    began (request migration: `resume_token_ids` were sent to the client already, and
    `emitted_chars` of their text). The stream carries EventNotes like a handoff's."""
    colocated: Literal[True]            # (no default: omit_defaults would leave it out of the body)
    resume_token_ids: list[int] = []
    emitted_chars: int = 0


KVParams = Union[PullPrefillParams, PushPrefillParams, PullDecodeParams, PushDecodeParams, ColocatedParams]
_PARAMS = {(True, Role.PREFILL): PullPrefillParams, (False, Role.PREFILL): PushPrefillParams,
           (True, Role.DECODE): PullDecodeParams, (False, Role.DECODE): PushDecodeParams}


def parse_params(data) -> KVParams:
    """`kv_transfer_params` as the Struct of its mode and role."""
    if not isinstance(data, dict):
        raise MessageError("kv_transfer_params must be an object")
    head = parse(_Head, data, "kv_transfer_params")
    check_version(head.protocol_version, "the router")
    if head.role not in ROLES:
        raise MessageError(f"kv_transfer_params.role: one of {', '.join(ROLES)}, not {head.role}")
    if data.get("colocated") is not None:
        if head.role != Role.DECODE:
            raise MessageError("kv_transfer_params.colocated: only a decode worker computes requests colocated")
        return parse(ColocatedParams, data, "kv_transfer_params")
    return parse(_PARAMS[head.mode.is_pull, head.role], data, "kv_transfer_params")


class _Head(msgspec.Struct):
    handoff_id: str
    mode: Mode
    role: Role
    protocol_version: int = 1           # a router from before versioning sends none


def params(handoff_id: str, mode: Mode, role: Role, colocated: bool = False, **fields) -> KVParams:
    """What the router puts into `kv_transfer_params`, as its Struct (msgspec encodes it in the body).
    (Not checked here: the worker checks everything.)"""
    assert role in ROLES and (role == Role.DECODE or not colocated)
    cls, fields = (ColocatedParams, fields | {"colocated": True}) if colocated else (_PARAMS[mode.is_pull, role], fields)
    return cls(handoff_id=handoff_id, mode=mode, role=role, protocol_version=PROTOCOL_VERSION,
               **{k: v for k, v in fields.items() if v is not None})


# ---------------------------------------------------------------------------------------------------
# Router or worker -> worker over HTTP (control token required)

class Rebind(Message):
    """Router -> prefill `/kv/rebind` (late-bound push): the handoff goes to a new decode worker,
    whose registration will carry `binding`. Refused (409) once the WRITE (or a layer-wise WRITE) has
    started; otherwise the current registration is withdrawn (its decode worker is told: Withdrawn)
    and only a registration of this binding is taken from now on."""
    handoff_id: str
    binding: int


class HandoffRef(Message):
    """`/kv/release` (pull: the pinned KV will not be read) and `/kv/cancel` (the router gave up)."""
    handoff_id: str


class KVFailed(Message):
    """Router -> decode `/kv/failed`: the push prefill leg failed (5xx, or its connection broke)."""
    handoff_id: str
    reason: str = "the prefill failed"
    prefill_answered: bool = False      # it answered, so no WRITE of it is still in flight
    recompute: bool | None = None       # the router's --retry-colocated overrides a `fail` policy


class RetainedRef(Message):
    """Router -> decode `/kv/retained/release`: the conversation moved on."""
    retention_id: str


class RetainedQuery(Message):
    """Router -> decode `/kv/retained/find`: is this conversation's history kept here? By the
    client's session id, else by the longest run of leading block hashes shared with the prompt.
    Lets any router find what another router's turn left (more than one router)."""
    session: str | None = None
    block_hashes: list[str] = []


class LeaseRequest(Message):
    """Prefill -> decode `/kv/retained/lease`: hold a retained conversation's blocks for a READ."""
    retention_id: str
    num_blocks: int


class ReadLease(Message):
    """The decode worker's answer to a LeaseRequest: where the blocks are, and their checksums."""
    lease_id: str
    block_ids: list[int]
    pool_blocks: int                    # how many blocks the decode worker's pool holds (kv_layout.py)
    checksums: list[int]
    agent_metadata: str
    num_tokens: int
    lease_s: float


class PromptQuery(Message):
    """Router -> worker `/kv/prompt`: the block hashes of a request's prompt (sessions by content)."""
    endpoint: str
    request: dict


# ---------------------------------------------------------------------------------------------------
# Worker -> router: the prefill's streamed answer, the decode's event notes, the handoff objects

class FirstToken(Message):
    """A prefill's first line (JSON lines: this, then {"handoff": ...} or {"error": ...}): the first
    token, sent the moment the prefill samples it. `sse` is what the client's stream begins with,
    exactly as colocated serving streams it (a chat stream's role chunk; the token's chunk when the
    detokenizer has text for it); the decode worker's stream continues after it."""
    token_id: int
    text: str
    sse: str
    phases_ms: Phases = {}              # prefill_queue, prefill_compute, and the worker's own time around them


class PrefillLine(Message):
    """One line of a prefill's answer: the first token, the handoff object, or the error that ended
    the handoff after its first token (with the HTTP status it would have had)."""
    first_token: FirstToken | None = None
    handoff: dict | None = None
    error: dict | None = None
    status: int = 502


# Per-request phases on the critical path of a disaggregated request's first token, in order; they
# add up to the router's TTFT. The router measures its own and the hops; the prefill worker reports
# the rest with its first token (FirstToken.phases_ms).
TTFT_PHASES = ("router_dispatch", "prefill_hops", "prefill_request", "prefill_queue", "prefill_compute", "relay")

EVENT_NOTE = ": kvh"


class EventNote(msgspec.Struct):
    """What a decode worker's SSE event carries for the router, as a comment line before its data
    (`: kvh ids=1,2 chars=17 first`), so the router can follow a stream without parsing its JSON:
    the token ids in the event, the characters of text emitted so far (the detokenizer's state, for
    a migration), and tags: `head` (a chat stream's role chunk), `first` (the first token's chunk,
    which the router may have sent from the prefill already), `final` (carries timings and the
    handoff object: the router rewrites it)."""
    ids: list[int]
    chars: int
    tags: frozenset = frozenset()

    def line(self) -> str:
        return note_line(self.ids, self.chars, "".join(f" {t}" for t in sorted(self.tags)))

    @classmethod
    def parse(cls, line: str) -> "EventNote | None":
        """The note in an SSE comment line, or None if it is not one (or is malformed)."""
        if not line.startswith(EVENT_NOTE):
            return None
        ids, chars, tags = None, None, set()
        for part in line[len(EVENT_NOTE):].split():
            key, _, value = part.partition("=")
            try:
                if key == "ids":
                    ids = [int(t) for t in value.split(",") if t]
                elif key == "chars":
                    chars = int(value)
                else:
                    tags.add(key)
            except ValueError:
                return None
        return None if ids is None or chars is None else cls(ids, chars, frozenset(tags))


def note_line(ids: list[int], chars: int, tags: str = "") -> str:
    """EventNote(ids, chars, tags).line() without building one: a decode worker writes one before
    every token's event, on its engine's core (the Struct and the sorted tags cost 3 us a token, a
    twentieth of the whole relay; this, 0.3-0.9). `tags`: each with a space before it (" final")."""
    joined = str(ids[0]) if len(ids) == 1 else ",".join(map(str, ids))
    return f"{EVENT_NOTE} ids={joined} chars={chars}{tags}\n"


class PushPrefillAnswer(Message):
    handoff_id: str
    prefill_worker: str
    num_kv_tokens: int
    blocks: int
    phases_ms: Phases
    bytes_transferred: int = 0
    bytes_before_prefill_end: int | None = None     # layer-wise: what left while the prompt computed
    reused_tokens: int = 0
    reverse_bytes: int = 0
    reuse_decision: dict | None = None
    prefill_cached_tokens: int = 0      # of the prompt, served by the prefill worker's own prefix cache


class Retained(Message):
    """A turn whose KV the decode worker keeps (bidirectional)."""
    retention_id: str
    num_tokens: int
    expires_in_s: float
    bytes: int
    block_hashes: list[str] = []        # (empty in the client's handoff object: protocol payload)
    session: str | None = None          # the client's session id it was kept under, if it named one


class DecodeReport(Message):
    """The decode worker's `handoff` object on its final output."""
    handoff_id: str
    mode: Mode
    decode_worker: str
    bytes_transferred: int
    blocks: int
    decode_cached_tokens: int
    kv_source: Literal["remote", "recomputed"]
    phases_ms: Phases
    error: str | None = None
    retained: Retained | None = None



class ClientHandoff(Message):
    """The `handoff` object the client of a disaggregated request gets (docs/HANDOFF.md), built by the
    router from the decode worker's DecodeReport, what the prefill's answer adds (PullHandoff or
    PushPrefillAnswer) and its own observations; also for a request the router had computed
    colocated on a decode worker (`kv_source` then names the field that says why)."""
    handoff_id: str
    mode: Mode
    prefill_worker: str | None
    decode_worker: str
    phases_ms: Phases                   # PHASES, and the router's TTFT_PHASES where measured
    router_ms: float | None             # arrival -> the first byte sent to a worker
    kv_source: str | None = None        # remote, recomputed, retried_colocated or colocated
    bytes_transferred: int | None = None
    bytes_before_prefill_end: int | None = None
    blocks: int | None = None
    decode_cached_tokens: int | None = None
    prefill_cached_tokens: int | None = None
    reused_tokens: int | None = None
    reverse_bytes: int | None = None
    reuse_decision: dict | None = None  # the prefill worker's (wire.cost.ReuseDecision)
    route_decision: dict | None = None  # the router's, with what the chosen worker measured
    retained: Retained | None = None    # where the conversation's KV is kept now (no hash chain)
    error: str | None = None            # the decode side's: why its KV was recomputed
    prefill_error: str | None = None    # push: why the prefill's answer is missing
    retried_colocated: str | None = None    # why the request was computed on the decode worker alone
    colocated: str | None = None        # ... or why it was never disaggregated (selective)
    retried_elsewhere: str | None = None
    rebound_from: str | None = None     # late binding: the decode worker it left
    migrated: list[dict] | None = None  # decode workers the stream moved away from, and why
    first_token_source: Literal["prefill", "decode"] | None = None

# ---------------------------------------------------------------------------------------------------
# Notifications between transfer agents (each names its handoff; a READ lease names its lease)

class _Note(msgspec.Struct, tag_field="kind"):
    pass


class Registration(_Note, tag="register"):
    """Push, decode -> prefill: where the handoff's KV must be written. (Over the agents' connection,
    authenticated at its handshake, which also refused a peer of another protocol version: as an HTTP
    request it cost the prefill's core ~0.7 ms of parsing while the prompt computed, issue 46.) A
    refusal comes back as Failed, or Withdrawn when the router moved the handoff elsewhere."""
    handoff_id: str
    mode: Mode
    decode_worker: str
    agent_metadata: str
    block_ids: list[int]                # every block of the prompt's KV on the decode side
    pool_blocks: int                    # how many blocks the decode worker's pool holds (kv_layout.py)
    num_kv_tokens: int
    prompt_hash: str
    ttl_ms: float                       # the timing rule (push.py): WRITEs start within one ttl of decode's last word
    skip_blocks: int = 0                # leading blocks decode holds already (its prefix cache): not written
    binding: int = 0                    # from the decode worker's params: a registration of another binding is refused


class Done(_Note, tag="done"):
    """Push, prefill -> decode, riding on the last WRITE: the KV is whole; these are its checksums."""
    handoff_id: str
    checksums: list[int]
    first_token: int


class Failed(_Note, tag="failed"):
    """Either way: this handoff failed on my side (a WRITE failed, the prompt was refused...)."""
    handoff_id: str
    reason: str


class Release(_Note, tag="release"):
    """Pull, decode -> prefill: read (or given up): unpin the blocks."""
    handoff_id: str


class Renew(_Note, tag="renew"):
    """Decode -> prefill, while it still waits: pull: keep the lease; push: the destination still
    stands (the WRITE may start up to one more ttl from now)."""
    handoff_id: str


class Progress(_Note, tag="progress"):
    """Push, prefill -> decode: more of the prompt was computed since the last one (keep-alive)."""
    handoff_id: str


class Cancel(_Note, tag="cancel"):
    """Either way: give this handoff up and free what it holds."""
    handoff_id: str


class Withdrawn(_Note, tag="withdrawn"):
    """Late-bound push, prefill -> decode: the router moved this handoff to another decode worker; no
    WRITE into your blocks will come (free them now)."""
    handoff_id: str


class Unlease(_Note, tag="unlease"):
    """Bidirectional, prefill -> decode: the READ of a retained conversation is over."""
    lease_id: str


Notification = Union[Registration, Done, Failed, Release, Renew, Progress, Cancel, Withdrawn, Unlease]


def decode_notification(raw: bytes) -> Notification:
    return parse(Notification, raw, "notification")
