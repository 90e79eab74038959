"""A request's prompt as its workers will see it: token ids and block chain, made by the router itself.

The index of what each worker holds (kv_index.py) is keyed by token blocks, so the router tokenizes
a prompt exactly as a worker does: with the same tokenizer and chat template (model/tokenizer.py,
made from the files the workers serve at /kv/tokenizer, fetched once per fingerprint their /health
names) and the same block chain (engine/block_pool.hash_chain). Both are torch-free modules the
router shares with the workers so that the two sides cannot disagree. A request this cannot read
(no tokenizer yet, a body the worker will refuse) is looked up the old way: by asking a worker.
"""
from __future__ import annotations

import asyncio
import logging

from jinja2 import TemplateError
from pydantic import ValidationError

from kvhandoff.engine.block_pool import hash_chain
from kvhandoff.model.tokenizer import Tokenizer
from kvhandoff.router.answer import UpstreamError
from kvhandoff.router.prefix import PromptFacts
from kvhandoff.router.upstream import Upstream
from kvhandoff.wire import api as P
from kvhandoff.wire.http import CHAT

log = logging.getLogger("kvhandoff.router")


class Prompts:
    def __init__(self):
        self.tokenizers: dict[str, Tokenizer] = {}      # fingerprint -> tokenizer
        self.fetching: set[str] = set()

    def want(self, upstream: Upstream, url: str, fingerprint: str) -> asyncio.Future | None:
        """Fetch the tokenizer a worker names, unless known or on its way (a background task's coroutine)."""
        if not fingerprint or fingerprint in self.tokenizers or fingerprint in self.fetching:
            return None
        self.fetching.add(fingerprint)
        return asyncio.ensure_future(self.fetch(upstream, url, fingerprint))

    async def fetch(self, upstream: Upstream, url: str, fingerprint: str) -> None:
        try:
            status, data = await upstream.call("GET", url + "/kv/tokenizer", timeout=30.0)
            if status != 200 or not isinstance(data, dict) or not isinstance(data.get("files"), dict):
                raise ValueError(f"answered {status}")
            # (Parsing a tokenizer.json of a few MB takes tens of ms: off the event loop.)
            tokenizer = await asyncio.to_thread(Tokenizer.from_files, data["files"])
            self.tokenizers[fingerprint] = tokenizer
            log.info("tokenizer %s from %s: prompts are looked up in the KV-event index", fingerprint, url)
        except (UpstreamError, ValueError, KeyError, TypeError) as e:
            log.warning("no tokenizer from %s (%s): prompts are looked up by asking the workers", url, e)
        finally:
            self.fetching.discard(fingerprint)

    def token_ids(self, fingerprint: str, endpoint: str, body: dict) -> list[int] | None:
        """The prompt's token ids as a worker with this tokenizer makes them; None if unknown here.
        (A completion's prompt of token ids needs no tokenizer.)"""
        tokenizer = self.tokenizers.get(fingerprint)
        prompt = body.get("prompt")
        try:
            if endpoint == CHAT:
                if tokenizer is None:
                    return None
                messages = P.ChatCompletionRequest.model_validate(body).template_messages()
                ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            else:
                ids = tokenizer.encode(prompt) if isinstance(prompt, str) and tokenizer is not None else prompt
        except (ValidationError, TemplateError, ValueError, TypeError, LookupError):      # the worker says why, with a 400
            return None
        return ids if isinstance(ids, list) and ids and set(map(type, ids)) == {int} else None

    def facts(self, fingerprint: str, block_size: int, endpoint: str, body: dict) -> PromptFacts | None:
        """The prompt's token count and block chain, made here (what each worker caches: the caller's)."""
        ids = self.token_ids(fingerprint, endpoint, body)
        if ids is None:
            return None
        keys = hash_chain(ids, block_size)
        return PromptFacts(len(ids), [k.hex() for k in keys], block_size, keys=keys)
