"""`IncrementalDetokenizer`: a request's output text, grown a token at a time without decoding it all again.

Decoding the whole output every step costs O(n) a token, O(n^2) a request: at hundreds of running requests with
long outputs that is milliseconds of every step. This decodes a short window instead, as vLLM does: the text of
`ids[prefix:]` minus the text of `ids[prefix:read]`, where `prefix..read` is a few tokens of context that byte-level
tokenizers need to merge a character split across tokens. New text is held back while it ends in U+FFFD (half a
character).

    ids:  ... | prefix ........ read | new tokens |
                 decoded twice, diffed
"""

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.text = ""
        self._prefix = self._read = 0

    def update(self, token_ids: list[int]) -> str:
        """Take the request's whole output so far; returns the text it adds. Mutates."""
        if self.tokenizer is None:
            return ""
        added = []
        while self._read < len(token_ids):
            new = self._step(token_ids, min(len(token_ids), self._read + 1))
            if new is None:
                break
            added.append(new)
        text = "".join(added)
        self.text += text
        return text

    def _step(self, ids: list[int], end: int) -> str | None:
        """Text of ids[read:end], or None while it is half a character (then wait for more tokens)."""
        prefix_text = self._decode(ids[self._prefix : self._read])
        full = self._decode(ids[self._prefix : end])
        if full.endswith(_REPLACEMENT) and end < len(ids):
            full = self._decode(ids[self._prefix : len(ids)])
            end = len(ids)
        if full.endswith(_REPLACEMENT) or len(full) < len(prefix_text):
            return None
        self._prefix, self._read = max(self._prefix, end - _CONTEXT_TOKENS), end
        return full[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def finish(self, token_ids: list[int]) -> str:
        """At the end: whatever was held back, replacement characters and all."""
        self.update(token_ids)
        if self._read < len(token_ids):
            rest = self._decode(token_ids[self._prefix :])[len(self._decode(token_ids[self._prefix : self._read])) :]
            self.text += rest
            self._read = len(token_ids)
            return rest
        return ""
