"""Plays the router from inside a network namespace (test_handoff_netns.py runs it there): waits for
a prefill and a decode worker at real addresses, runs each handoff mode (or those named in the third
argument, on the prompts whose indices the fourth names), prints JSON results: the text, the decode
worker's handoff object, and the prefill worker's."""
from __future__ import annotations

import json
import sys
import time

import httpx

from test_handoff import MODES, PROMPTS, body, disaggregated


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} never became healthy")


def main() -> None:
    prefill, decode = sys.argv[1], sys.argv[2]
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else MODES
    prompts = [PROMPTS[int(i)] for i in sys.argv[4].split(",")] if len(sys.argv) > 4 else PROMPTS[:4]
    for url in (prefill, decode):
        wait_healthy(url)
    results = {}
    for mode in modes:
        results[mode] = []
        for prompt in prompts:
            prefill_side, response = disaggregated(prefill, decode, mode, body(prompt))
            results[mode].append({"text": response["choices"][0]["text"], "handoff": response["handoff"],
                                  "prefill_handoff": {k: v for k, v in prefill_side.items()
                                                      if k not in ("block_ids", "checksums", "prompt_token_ids",
                                                                   "agent_metadata")}})
    health = {url: httpx.get(f"{url}/health", timeout=5).json() for url in (prefill, decode)}
    print(json.dumps({"results": results, "health": health}))


if __name__ == "__main__":
    main()
