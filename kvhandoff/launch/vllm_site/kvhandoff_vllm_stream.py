"""Run vLLM's OpenAI server with streamed answers that say where their KV is kept, as its non-streamed
answers do: `python -m kvhandoff_vllm_stream [api_server flags]`, in vLLM's own interpreter (kvhandoff's
launcher puts this folder on its PYTHONPATH; nothing of kvhandoff is imported here).

Stock vLLM 0.32 returns a request's `kv_transfer_params` only in a non-streamed answer, so a router
cannot hand a streamed turn's KV to the next turn's prefill (bidirectional reuse); the published
reproduction of that feature patches its streaming the same way. Here a stream whose final output
carries them gets one more chunk before `data: [DONE]`, shaped as the usage chunk is (no choices):
{"id", "object", "created", "model", "choices": [], "kv_transfer_params": {...}}. kvhandoff's router
takes it and does not pass it on. Where the serving classes are not found (another vLLM version), the
server runs unpatched and says so.
"""
import functools
import inspect
import json
import runpy
import sys


def patch(cls, name: str) -> None:
    original = getattr(cls, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    async def streamed(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        results, seen = bound.arguments["result_generator"], {}

        async def watched():
            async for item in results:
                output = item[1] if isinstance(item, tuple) else item
                if getattr(output, "kv_transfer_params", None):
                    seen["params"] = output.kv_transfer_params
                seen.setdefault("id", getattr(output, "request_id", None))
                yield item
        bound.arguments["result_generator"] = watched()
        head = None
        async for chunk in original(*bound.args, **bound.kwargs):
            if chunk.startswith("data: {") and head is None:
                try:
                    first = json.loads(chunk[6:])
                    head = {k: first.get(k) for k in ("id", "object", "created", "model")}
                except ValueError:
                    head = {}
            if chunk.startswith("data: [DONE]") and seen.get("params") is not None:
                extra = {**(head or {}), "choices": [], "kv_transfer_params": seen["params"]}
                yield f"data: {json.dumps(extra, separators=(',', ':'))}\n\n"
            yield chunk
    setattr(cls, name, streamed)


def main() -> None:
    sys.modules.setdefault("kvhandoff_vllm_stream", sys.modules[__name__])     # (run as __main__: known by name too)
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        patch(OpenAIServingCompletion, "completion_stream_generator")
        patch(OpenAIServingChat, "chat_completion_stream_generator")
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"kvhandoff_vllm_stream: streamed answers left as they are ({exc})", file=sys.stderr, flush=True)
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
