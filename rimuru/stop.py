"""`StopChecker`: whether a request ends after its newest token, and why (vLLM's finish and stop reasons).

Order: a stop token id or EOS ("stop"), then a stop string in the detokenised output ("stop"), then the length
limit ("length"). Nothing but the length limit applies before `min_tokens`.
"""

from rimuru.detokenizer import IncrementalDetokenizer
from rimuru.request import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, request: Request) -> tuple[str | None, int | str | None]:
        """(finish_reason, stop_reason) or (None, None) to go on. Does not mutate."""
        params, output = request.params, request.output_token_ids
        token = output[-1]
        if len(output) >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            stop = self.find_stop_string(request)
            if stop is not None:
                return "stop", stop
        if len(output) >= request.max_tokens:
            return "length", None
        return None, None

    def find_stop_string(self, request: Request) -> str | None:
        stops = request.params.stop
        if not stops:
            return None
        text = self.text_of(request)
        return next((s for s in stops if s in text), None)  # checked every token: the first occurrence wins

    def text_of(self, request: Request) -> str:
        """The request's output text so far, decoded incrementally; a trailing half character is held back."""
        if self.tokenizer is None:
            return ""
        if request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.skip_special_tokens)
        request.detokenizer.update(request.output_token_ids)
        return request.detokenizer.text

    def output_text(self, request: Request) -> str:
        """The whole output text, cut before the stop string that ended it."""
        if self.tokenizer is None:
            return ""
        self.text_of(request)
        request.detokenizer.finish(request.output_token_ids)
        text = request.detokenizer.text
        if isinstance(request.stop_reason, str):
            text = text[: text.find(request.stop_reason)]
        return text
