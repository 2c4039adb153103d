"""OpenAI response bodies and stream chunks from the engine loop's deltas: `text_completion` and `chat.completion`.

One formatter per HTTP request; it keeps the little per-choice state a stream needs (text offsets for completion
logprobs, whether a chat choice has sent its role yet). Pure: no engine, no I/O.
"""

import time

from rimuru.serving.choice import Delta, TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


class _Choice:
    """A finished choice, gathered from its deltas."""

    def __init__(self, index: int):
        self.index, self.text, self.token_ids = index, "", []
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason, self.stop_reason = None, None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.text = delta.full_text if delta.full_text is not None else self.text


class Formatter:
    object_name = chunk_object_name = ""

    def __init__(self, request_id: str, model: str, num_choices: int):
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.choices = [_Choice(i) for i in range(num_choices)]
        self.prompt_tokens = 0

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)

    def _envelope(self, object_name: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def add(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            self.choices[delta.index].add(delta)

    def response(self) -> dict:
        return self._envelope(self.object_name, [self._final_choice(c) for c in self.choices], usage=self.usage())

    def chunks(self, deltas: list[Delta], include_usage: bool) -> list[dict]:
        """Stream chunks for one engine step's deltas (and the gathered state, for usage)."""
        extra = {"usage": None} if include_usage else {}
        out = [self._envelope(self.chunk_object_name, [c], **extra) for d in deltas for c in self._chunk_choices(d)]
        self.add(deltas)
        return out

    def usage_chunk(self) -> dict:
        return self._envelope(self.chunk_object_name, [], usage=self.usage())

    def _final_choice(self, choice: _Choice) -> dict:
        raise NotImplementedError

    def _chunk_choices(self, delta: Delta) -> list[dict]:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, num_choices: int, return_token_ids: bool = False):
        super().__init__(request_id, model, num_choices)
        self._offsets = [0] * num_choices
        self.return_token_ids = return_token_ids

    def _final_choice(self, choice: _Choice) -> dict:
        logprobs = None if choice.logprobs is None else self._logprobs(choice.logprobs, 0)
        return {"index": choice.index, "text": choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                **self._token_ids(choice.token_ids)}  # fmt: skip

    def _chunk_choices(self, delta: Delta) -> list[dict]:
        new_ids = self.return_token_ids and delta.token_ids
        if not delta.text and not delta.finish_reason and not delta.logprobs and not new_ids:
            return []
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self._logprobs(delta.logprobs, self._offsets[delta.index])
            self._offsets[delta.index] += sum(len(t.token) for t in delta.logprobs)
        return [{"index": delta.index, "text": delta.text, "logprobs": logprobs,
                 "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                 **self._token_ids(delta.token_ids)}]  # fmt: skip

    def _token_ids(self, token_ids: list[int]) -> dict:
        return {"token_ids": list(token_ids)} if self.return_token_ids else {}

    @staticmethod
    def _logprobs(entries: list[TokenLogprob], offset: int) -> dict:
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token: lp for _, token, lp in e.top} for e in entries],
            "text_offset": offsets,
        }


class ChatFormatter(Formatter):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, num_choices: int):
        super().__init__(request_id, model, num_choices)
        self._sent_role = [False] * num_choices

    def _final_choice(self, choice: _Choice) -> dict:
        logprobs = None if choice.logprobs is None else self._logprobs(choice.logprobs)
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text}, "logprobs": logprobs,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}  # fmt: skip

    def _chunk_choices(self, delta: Delta) -> list[dict]:
        out = []
        if not self._sent_role[delta.index]:
            self._sent_role[delta.index] = True
            out.append({"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})  # fmt: skip
        if delta.text or delta.finish_reason or delta.logprobs:
            logprobs = None if delta.logprobs is None else self._logprobs(delta.logprobs)
            body = {"content": delta.text} if delta.text else {}
            out.append({"index": delta.index, "delta": body, "logprobs": logprobs,
                        "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason})  # fmt: skip
        return out

    @staticmethod
    def _logprobs(entries: list[TokenLogprob]) -> dict:
        def item(token: str, logprob: float, raw: bytes) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(raw or token.encode("utf-8"))}

        def top(e: TokenLogprob) -> list[dict]:
            raws = e.top_bytes or [b""] * len(e.top)
            return [item(t, lp, raw) for (_, t, lp), raw in zip(e.top, raws, strict=True)]

        return {"content": [item(e.token, e.logprob, e.token_bytes) | {"top_logprobs": top(e)} for e in entries]}
