"""vLLM workers behind our router (`--engine vllm`): the same legs (legs.py: pull picks the decode
worker when the prefill answered, push sends both legs at arrival), the same relay, retries and
migration, with vLLM 0.32's messages (wire/vllm.py) in place of ours.

What differs from our own workers, and how it is bridged here:
- The prefill leg is a one-token request with `do_remote_decode` (and `return_token_ids`); its JSON
  answer carries the first token and the `kv_transfer_params` for the decode leg. Under greedy
  sampling (`temperature` 0) that token goes to the client at once, in the chunk vLLM would stream for
  it; the decode worker recomputes it from the KV and the relay drops its copy (a different one is a
  failure: the stream migrates). Otherwise the first token comes from the decode worker: its sample
  could differ from the prefill's, and the text would not be one sample.
- Push: both legs carry the same `X-Request-Id`, the decode leg the prefill engine's coordinates,
  learned from any answer of that worker (a one-token probe the first time).
- vLLM's chunks carry no notes for the relay: `VllmEvents` reads each chunk's token ids
  (`return_token_ids`, asked on every leg and removed again where the client did not ask) and writes
  the note a worker of ours would have, so a stream can be followed, and migrated: the continuation
  is a completion of the prompt's token ids plus those sent, on another decode worker, reshaped into
  chat chunks for a chat stream.
- Bidirectional (pull): the decode worker's non-streamed answer names the blocks it keeps; the router
  keeps them per conversation (`VllmSessions`) and gives them to the next turn's prefill leg, only
  when its prompt's tokens (vLLM's /tokenize) begin with the kept ones: vLLM reads them unchecked.
  Stock vLLM returns them only in non-streamed answers; `up --engine vllm --bidirectional` runs its
  servers with a patch (launch/vllm_site/) that ends a stream with them too, in a chunk of its own
  that the relay takes and does not pass on. Against stock servers a streamed turn is not kept (the
  last non-streamed one of the conversation still is). The map is this router's own: not shared.
- Control messages (/kv/cancel, /kv/release, ...) have no vLLM counterpart: a closed connection
  aborts a request there, and a pull prefill's pinned blocks wait out its lease.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvhandoff.router.answer import Answer, UpstreamError
from kvhandoff.router.attempt import Attempt, timings_of
from kvhandoff.router.errors import WorkerFailure, worker_failure
from kvhandoff.router.pool import Worker
from kvhandoff.router.upstream import data_json, sse_events
from kvhandoff.router.vllm_sessions import VllmSessionEntry
from kvhandoff.wire import messages as M
from kvhandoff.wire import vllm as V
from kvhandoff.wire.http import CHAT, COMPLETIONS, sse_event
from kvhandoff.wire.modes import FinishReason, Role

log = logging.getLogger("kvhandoff.router")

# Fields vLLM adds to chunks and answers for `return_token_ids`; removed where the client did not ask.
TOKEN_FIELDS = ("token_ids", "prompt_token_ids", "prompt_text")
# Sampling fields a migrated stream's continuation keeps (it is a completion of token ids).
CONTINUATION_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                       "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")
# Client options under which the prefill's first token is not the chunk vLLM would stream first
# (scores, several choices, echoed prompts, tool calls): the decode worker's stream is relayed whole.
NO_EARLY_FIRST = ("logprobs", "top_logprobs", "echo", "tools", "response_format", "guided_json", "structured_outputs")


def strip_token_fields(obj: dict) -> None:
    for key in TOKEN_FIELDS:
        obj.pop(key, None)
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            for key in TOKEN_FIELDS:
                choice.pop(key, None)


@dataclass
class VllmState:
    """What the router knows of its vLLM workers beyond their health: each prefill engine's NIXL
    coordinates (push), refreshed from its answers and forgotten when it stops answering."""
    coordinates: dict[str, V.EngineCoordinates] = field(default_factory=dict)

    def known(self, worker: Worker) -> V.EngineCoordinates | None:
        if not worker.healthy or worker.unreachable_since is not None:
            self.coordinates.pop(worker.url, None)      # (a restarted engine has another id)
        return self.coordinates.get(worker.url)


@dataclass
class VllmAttempt(Attempt):
    prompt_ids: list[int] | None = None         # the prompt's token ids, from the first answer that had them
    remote_raw: dict | None = None              # pull: the prefill's kv_transfer_params, as they came
    prefill_kv: V.RemoteKV | None = None        # the prefill's answer, typed
    reuse: VllmSessionEntry | None = None       # bidirectional: the history this turn's prefill reads
    reuse_decision: dict | None = None          # ... and why it does or does not
    decode_first_ms: float | None = None        # arrival -> the decode worker's first event

    # -- what differs in the messages -----------------------------------------------------------------
    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def early_first(self) -> bool:
        """May the prefill's token go to the client first? Only if the decode worker must make the same one."""
        body = self.body
        return body.get("temperature") == 0 and (body.get("n") or 1) == 1 and not any(body.get(k) for k in NO_EARLY_FIRST)

    def headers(self) -> dict:
        return {"X-Request-Id": self.handoff_id}

    def next_attempt(self) -> None:
        super().next_attempt()
        self.remote_raw = self.prefill_kv = self.decode_first_ms = None

    def worker_body(self, role: Role, **extra) -> dict:
        body = dict(self.body)
        body["return_token_ids"] = True         # notes for the relay; the prompt's ids for a migration
        if role == Role.PREFILL:
            for key in ("stream_options", "max_completion_tokens", "min_tokens"):
                body.pop(key, None)
            body.update(stream=False, max_tokens=1)
            params = self.reuse.params if self.reuse is not None else V.PrefillParams().to_dict()
        elif extra.get("colocated"):
            params = None
        elif extra.get("remote") is not None:
            params = self.remote_raw
        else:
            engine = extra["engine"]
            params = V.PushDecodeParams.to(engine, V.base_request_id(self.handoff_id, self.chat)).to_dict()
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    def tell(self, worker: Worker, path: str, **fields) -> None:
        """vLLM has no control endpoints: a closed connection aborts the request on its side."""

    def report_prefill_failure(self, failure: BaseException) -> None:
        """Push: the prefill failed with both legs out. vLLM's decode worker would wait for a WRITE
        until its registration watchdog: close its leg (it aborts and frees), and let the relay's
        retry take over with the prefill's failure as the reason."""
        self.cause = failure
        for resp in self.upstream:
            resp.close()

    # -- the legs -------------------------------------------------------------------------------------
    async def run_prefill(self, **extra) -> V.RemoteKV:
        worker, first_token = self.prefill, self.first_token
        try:
            while True:
                self.prefill_sent_ms = self.ms()
                resp = await self.post(worker, self.worker_body(Role.PREFILL))
                data = await self.read_json(worker, resp)
                self.first_received_ms = self.ms()
                remote, params = self.prefill_answer(worker, data)
                if self.reuse is None or self.reuse.extended_by(data, remote):
                    break
                self.drop_reuse("the prefill's prompt tokens do not begin with the kept history (or its read "
                                "failed): computed again without it")
            first = self.first_of(data)
            if first is not None and not first_token.done():
                first_token.set_result(first)
        finally:
            if not first_token.done():
                first_token.set_result(None)
        self.unhold(worker)
        self.prefill_kv = remote
        if self.mode.is_pull:
            self.remote, self.remote_raw = remote, params
        self.open_legs.discard(Role.PREFILL)
        return remote

    def prefill_answer(self, worker: Worker, data: dict) -> tuple[V.RemoteKV, dict]:
        """The prefill's kv_transfer_params, typed and checked against the router's mode."""
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise WorkerFailure(worker, f"the {worker} answered without kv_transfer_params: is it a vLLM server "
                                "started with --kv-transfer-config and a NIXL connector?", "bad_worker_answer")
        try:
            remote = V.parse_remote(params, "the prefill's kv_transfer_params")
        except ValueError as exc:
            raise WorkerFailure(worker, f"the {worker} answered {exc}", "bad_worker_answer") from None
        mode = "pull" if self.mode.is_pull else "push"
        if remote.transfer_mode not in (None, mode):
            raise WorkerFailure(worker, f"the {worker} runs {V.CONNECTORS.get(remote.transfer_mode, remote.transfer_mode)}"
                                f" ({remote.transfer_mode}); this router is in {mode} mode: start it with "
                                f"{V.CONNECTORS[mode]}", "connector_mismatch")
        self.router.vllm.coordinates[worker.url] = remote.coordinates()
        if self.prompt_ids is None:
            choice = (data.get("choices") or [{}])[0]
            self.prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        return remote, params

    def first_of(self, data: dict) -> M.FirstToken | None:
        """The prefill's token as the client's stream would begin with it, when it may go first."""
        if not self.stream or not self.early_first:
            return None
        choice = (data.get("choices") or [None])[0]
        if not isinstance(choice, dict) or choice.get("finish_reason") != FinishReason.LENGTH or not choice.get("token_ids"):
            return None
        token_id = choice["token_ids"][0]
        text = (choice.get("message") or {}).get("content") if self.chat else choice.get("text")
        if not text:
            return None
        head = {"id": data.get("id"), "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": data.get("created"), "model": data.get("model")}
        ids = {"token_ids": [token_id]} if self.wants_ids else {}
        if self.chat:
            role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}]}
            if self.wants_ids:
                role.update(prompt_token_ids=self.prompt_ids, prompt_text=None)
            sse = sse_event(role) + sse_event({**head, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                                                    "finish_reason": None, **ids}]})
        else:
            prompt = {"prompt_token_ids": self.prompt_ids} if self.wants_ids else {}
            sse = sse_event({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                                                  "stop_reason": None, **prompt, **ids}]})
        return M.FirstToken(token_id, text, sse)

    async def open_decode(self, **extra) -> Answer:
        if self.mode.is_push and "prefill_url" in extra:
            extra["engine"] = await self.engine_of(self.prefill)
        return await super().open_decode(**extra)

    async def engine_of(self, worker: Worker) -> V.EngineCoordinates:
        """A push prefill engine's coordinates; the first time, a one-token request asks them (its answer
        carries them; the one block it keeps is freed when vLLM's lease on it ends)."""
        state = self.router.vllm
        known = state.known(worker)
        if known is not None:
            return known
        body = {"model": self.body.get("model"), "prompt": [0], "max_tokens": 1, "stream": False,
                "kv_transfer_params": V.PrefillParams().to_dict()}
        try:
            status, data = await self.router.upstream.call("POST", worker.url + COMPLETIONS, body, timeout=30.0)
        except UpstreamError as e:
            raise worker_failure(worker, e) from None
        if status != 200 or not isinstance(data, dict):
            raise WorkerFailure(worker, f"the {worker} answered {status} when asked for its engine's "
                                "coordinates", "bad_worker_answer")
        return self.prefill_answer(worker, data)[0].coordinates()

    async def resume_on(self, worker: Worker, token_ids: list[int], emitted_chars: int) -> Answer:
        """Migration: a completion of the prompt's token ids and those sent, on `worker` (vLLM continues
        from token ids; a chat stream's chunks are reshaped by VllmEvents)."""
        self.decode = worker
        if not token_ids:
            return await self.post(worker, self.worker_body(Role.DECODE, colocated=True))
        if self.prompt_ids is None:
            raise WorkerFailure(worker, "cannot continue the stream: the prompt's token ids are unknown",
                                "worker_failed")
        body = {k: self.body[k] for k in CONTINUATION_FIELDS if k in self.body}
        body.update(prompt=self.prompt_ids + token_ids, stream=True, return_token_ids=True)
        if self.body.get("stream_options"):
            body["stream_options"] = self.body["stream_options"]
        limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        if limit is not None:
            body["max_tokens"] = max(1, limit - len(token_ids))
        if self.body.get("min_tokens"):
            body["min_tokens"] = max(0, self.body["min_tokens"] - len(token_ids))
        self.continuation = (len(token_ids), emitted_chars)
        return await self.post(worker, body, endpoint=COMPLETIONS)

    # -- what the client gets -------------------------------------------------------------------------
    def events(self, resp: Answer):
        continuation, self.continuation = self.continuation, None
        return VllmEvents(self, continuation).run(resp)

    async def read_json(self, worker: Worker, resp: Answer) -> dict:
        data = await super().read_json(worker, resp)
        if worker.role == Role.DECODE:
            self.decode_first_ms = self.decode_first_ms or self.ms()
            if self.config.bidirectional and not self.retried:
                self.router.sessions.keep(self, data)
            data.pop("kv_transfer_params", None)
            if not self.wants_ids:
                strip_token_fields(data)
            data.setdefault("handoff", {})
            data.setdefault("timings", {})
        return data

    async def merge(self, decode_handoff: dict | None) -> M.ClientHandoff:
        """The client's handoff object: what the router saw of each leg, and what vLLM's answers said
        of the KV (blocks, the prefill's cached tokens, the history read back)."""
        if self.merged is not None:
            return self.merged
        prefill, prefill_error = await self.prefill_outcome(self.prefill_kv)
        phases = dict.fromkeys(M.PHASES) | self.leg_phases()
        merged = M.ClientHandoff(self.handoff_id, self.mode, self.prefill.url if self.prefill else None,
                                 self.decode.url, phases, self.router_ms, kv_source="remote")
        if isinstance(prefill, V.RemoteKV):
            merged.blocks = prefill.blocks
            # vLLM counts the prompt tokens its prefill did not compute, from its own prefix cache and
            # from a kept history alike, as one number: given a history, all of it counts as reused.
            served = prefill.remote_prefill_cached_tokens
            if self.reuse is not None:
                merged.reused_tokens = served
            else:
                merged.prefill_cached_tokens, merged.reused_tokens = served, 0
        merged.reuse_decision = self.reuse_decision
        if self.migrations:
            merged.migrated = self.migrations
        if self.first_token_ms is not None:
            merged.first_token_source = Role.PREFILL if self.first_from_prefill else Role.DECODE
        merged.prefill_error, merged.retried_elsewhere = prefill_error, self.retry_reason
        self.merged = merged
        self.router.merged(self, merged, None)
        return merged

    def timings(self, worker_timings: dict | None) -> dict:
        """`timings` from the router's clock (vLLM reports none): queue is the router's own, until the
        prefill leg left (the decode leg, computed colocated); prefill the rest until the first token."""
        total = self.ms()
        queue = self.prefill_sent_ms if self.prefill_sent_ms is not None and not self.retried else self.decode_sent_ms
        ttft = self.first_token_ms if self.first_token_ms is not None else (self.first_received_ms or self.decode_first_ms)
        queue = min(queue or 0.0, ttft if ttft is not None else total)
        return timings_of(queue, ttft, total)

    def leg_phases(self) -> dict:
        """The phases the router sees of vLLM workers (they report none per request): arrival -> prefill
        leg sent (router_dispatch), the prefill leg's whole answer (prefill_leg), the decode leg sent ->
        its first event (decode_first_event: the transfer and first step from here), our relay."""
        phases = {}
        if self.prefill_sent_ms is not None:
            phases["router_dispatch"] = self.prefill_sent_ms
            if self.first_received_ms is not None:
                phases["prefill_leg"] = round(self.first_received_ms - self.prefill_sent_ms, 3)
        if self.decode_sent_ms is not None and self.decode_first_ms is not None:
            phases["decode_first_event"] = round(self.decode_first_ms - self.decode_sent_ms, 3)
        if self.first_from_prefill and self.first_token_ms is not None and self.first_received_ms is not None:
            phases["relay"] = round(self.first_token_ms - self.first_received_ms, 3)
        return phases

    def drop_reuse(self, why: str) -> None:
        if self.reuse is not None:
            self.router.sessions.forget(self.reuse)
            self.reuse_decision = {"choice": "recompute", "reason": why, "kept_tokens": self.reuse.num_tokens}
            self.reuse, self.candidate = None, None


class VllmEvents:
    """A vLLM decode stream as the relay reads our workers' (relay.py): each event with the note our
    workers write before it (token ids, characters so far, head/first/final/error tags), the final
    chunk marked for the merged handoff object, token ids removed where the client did not ask for
    them, and a migration's continuation (a completion) reshaped into the chunks of the client's
    endpoint."""

    def __init__(self, attempt: VllmAttempt, continuation: tuple[int, int] | None):
        self.attempt = attempt
        self.continuing = continuation is not None
        self.chars = continuation[1] if continuation else 0
        self.first_seen = self.continuing      # (a continuation's first token is not the stream's first)
        self.ids: list[int] = []                # this answer's token ids and text, for a kept turn
        self.text = ""

    async def run(self, resp: Answer):
        attempt = self.attempt
        async for lines in sse_events(resp):
            if attempt.decode_first_ms is None:
                attempt.decode_first_ms = attempt.ms()
            chunk = data_json(lines)
            if chunk is None:                   # data: [DONE], a comment
                yield lines
                continue
            if "error" in chunk:
                yield [M.EventNote([], self.chars, frozenset({"error"})).line().rstrip("\n"), *lines]
                continue
            if "kv_transfer_params" in chunk:       # (vllm_site/kvhandoff_vllm_stream.py: where the KV is kept)
                self.kept(chunk["kv_transfer_params"])
                continue
            yield self.noted(chunk)

    def kept(self, params) -> None:
        """A streamed turn's KV, kept by the decode worker: remembered as a whole answer's would be."""
        attempt = self.attempt
        if not attempt.config.bidirectional or attempt.retried or self.continuing:
            return
        content = {"message": {"content": self.text}} if attempt.chat else {"text": self.text}
        attempt.router.sessions.keep(attempt, {"kv_transfer_params": params, "prompt_token_ids": attempt.prompt_ids,
                                               "choices": [{"token_ids": self.ids, **content}]})

    def noted(self, chunk: dict) -> list[str]:
        attempt = self.attempt
        choice = (chunk.get("choices") or [None])[0]
        tags, ids = set(), []
        if isinstance(choice, dict):
            ids = choice.get("token_ids") or []
            if attempt.prompt_ids is None:
                attempt.prompt_ids = chunk.get("prompt_token_ids") or choice.get("prompt_token_ids")
            if self.continuing and attempt.chat:
                chunk = self.as_chat(chunk, choice)
                choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            text = delta.get("content") if attempt.chat else choice.get("text")
            self.chars += len(text or "")
            self.ids += ids
            self.text += text or ""
            if attempt.chat and "role" in delta and not ids and not text:
                tags.add("head")
            if ids and not self.first_seen:
                self.first_seen = True
                tags.add("first")
            if choice.get("finish_reason") is not None:
                tags.add("final")
        elif chunk.get("usage") is not None:    # the usage chunk (stream_options.include_usage)
            tags.add("final")
        if self.continuing:
            chunk.pop("prompt_token_ids", None)
            if isinstance(choice, dict):
                choice.pop("prompt_token_ids", None)
        if not attempt.wants_ids:
            strip_token_fields(chunk)
        if "final" in tags:
            chunk.setdefault("handoff", {})
            chunk.setdefault("timings", {})
        return [M.EventNote(list(ids), self.chars, frozenset(tags)).line().rstrip("\n"), sse_event(chunk).rstrip("\n")]

    def as_chat(self, chunk: dict, choice: dict) -> dict:
        """A continuation's completion chunk as the chat chunk the client's stream is made of."""
        attempt = self.attempt
        delta = {"content": choice.get("text") or ""}
        out = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": choice.get("finish_reason"),
               "stop_reason": choice.get("stop_reason")}
        if choice.get("token_ids") is not None:
            out["token_ids"] = choice["token_ids"]
        chat = {"id": f"chatcmpl-{attempt.handoff_id}", "object": "chat.completion.chunk", "created": chunk.get("created"),
                "model": chunk.get("model"), "choices": [out]}
        if chunk.get("usage") is not None:
            chat["usage"] = chunk["usage"]
        return chat
