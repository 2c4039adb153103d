"""`Choice`: one sequence of a submission as the client sees it, and the `Delta`s that carry its new output.

Owns what has been sent so far. Text is held back while it may still become a stop string (the longest stop
string minus one character) or while it ends in half a UTF-8 character (the tokenizer's U+FFFD), so streamed text
never has to be taken back; the last delta carries the full output as the stop checker cuts it. Runs on the engine
thread (the tokenizer is engine state).
"""

import functools
from dataclasses import dataclass, field

from rimuru.request import Request
from rimuru.serving.submission import Submission


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]  # (token id, token, log-probability), most likely first
    token_bytes: bytes = b""  # the token's own bytes (a part of a UTF-8 character stays that part)
    top_bytes: list[bytes] = field(default_factory=list)  # the same for each of `top`


@dataclass
class Delta:
    """New output of one choice since its last delta; `full_text` is the whole output once it finished."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    full_text: str | None = None


class Choice:
    def __init__(self, submission: Submission, index: int, request: Request):
        self.submission, self.index, self.request = submission, index, request
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.last_token_time: float | None = None

    def delta(self, stop_checker, tokenizer) -> Delta:
        """What is new since the last call. Mutates the sent counters."""
        request = self.request
        new_tokens = request.output_token_ids[self.num_sent_tokens :]
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = _logprobs(request, self.num_sent_tokens, tokenizer)
        self.num_sent_tokens = len(request.output_token_ids)
        if request.is_finished:
            text = stop_checker.output_text(request)
            return Delta(self.index, text[self.num_sent_chars :], new_tokens, logprobs, request.finish_reason,
                         request.stop_reason, text)  # fmt: skip
        text = stop_checker.text_of(request)
        safe = len(text) - max((len(s) - 1 for s in request.params.stop), default=0)
        while safe > self.num_sent_chars and text[safe - 1] == "\ufffd":
            safe -= 1
        delta_text = text[self.num_sent_chars : max(safe, self.num_sent_chars)]
        self.num_sent_chars += len(delta_text)
        return Delta(self.index, delta_text, new_tokens, logprobs)


def _logprobs(request: Request, start: int, tokenizer) -> list[TokenLogprob]:
    num_top = request.params.logprobs or 0
    out = []
    for token_id, entry in zip(request.output_token_ids[start:], (request.logprobs or [])[start:]):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        out.append(TokenLogprob(token_id, token_text(tokenizer, token_id), entry.get(token_id, float("-inf")),
                                [(t, token_text(tokenizer, t), lp) for t, lp in top], token_bytes(tokenizer, token_id),
                                [token_bytes(tokenizer, t) for t, _ in top]))  # fmt: skip
    return out


def token_text(tokenizer, token_id: int) -> str:
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for: byte-level BPE pieces (Qwen's) mapped back through GPT-2's byte alphabet, so a
    token holding half a UTF-8 character gives those bytes, not U+FFFD's."""
    if tokenizer is None:
        return token_text(tokenizer, token_id).encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    alphabet = _byte_alphabet()
    if piece is not None and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return token_text(tokenizer, token_id).encode()


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
