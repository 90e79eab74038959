"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds, min_tokens."""
from __future__ import annotations

import torch

from kvhandoff.engine.request import Request
from kvhandoff.model import kernels


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of `logits` [N, vocab] (float32, CPU) as torch's argmax gives it (the
    first index of the maximum; a NaN counts as the maximum), by the CPU kernels' (one C call) or else
    numpy's. Torch's took 855 us for SmolLM2's 16 x 49,152 logits and 43 us for one row, numpy's 48
    and 4 (one thread, Zen 4, 2026-12-05). But a decode step runs this from cold caches (the weights
    just streamed through them), where every distinct torch or numpy operation costs tens of
    microseconds: numpy's argmax of one row ~55 us there; the C call's code is warm from the step."""
    if kernels.available() and logits.stride(-1) == 1:
        return kernels.argmax_rows(logits)
    return logits.numpy().argmax(axis=-1).tolist()


class Sampler:
    def __init__(self, eos_token_ids: list[int], vocab_size: int, seed: int = 0):
        self.eos_token_ids, self.vocab_size = eos_token_ids, vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row of `logits` [N, vocab] (float32, on CPU)."""
        if logits.dtype != torch.float32 or not logits.is_cpu:
            logits = logits.float().cpu()
        early = [row for row, request in enumerate(requests)
                 if len(request.output_token_ids) < request.params.min_tokens]
        if early:
            with torch.inference_mode():        # (the logits are an inference tensor: masked in place)
                for row in early:
                    self._mask_early_stop(logits[row], requests[row])
        if all(r.params.greedy for r in requests):
            return greedy_tokens(logits)        # (outside inference mode: entering it cold costs ~40 us)
        with torch.inference_mode():
            return [self._sample_row(logits[row], request) for row, request in enumerate(requests)]

    def _mask_early_stop(self, row: torch.Tensor, request: Request) -> None:
        """Before min_tokens, stop tokens must not be produced at all (not merely ignored)."""
        params = request.params
        banned = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
        if banned:
            row[banned] = float("-inf")

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        params = request.params
        if params.greedy:
            return greedy_tokens(row.unsqueeze(0))[0]
        row = row / params.temperature
        if params.top_k > 0 and params.top_k < row.numel():
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(request)))

    def _generator(self, request: Request) -> torch.Generator:
        if request.params.seed is None:
            return self.generator
        gen = self.request_generators.get(request.request_id)
        if gen is None:
            gen = self.request_generators[request.request_id] = torch.Generator().manual_seed(request.params.seed)
        return gen

    def skip(self, request: Request) -> None:
        """Advance a seeded request's random stream past one draw, made elsewhere (a prefill worker
        sampled its first token): the next draw is then the one colocated serving would make.
        multinomial without replacement consumes one number per vocabulary entry whatever the
        probabilities, so a uniform draw over the same vocabulary advances the stream identically."""
        if request.params.greedy or request.params.seed is None:
            return
        torch.multinomial(torch.ones(self.vocab_size), 1, generator=self._generator(request))

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)
