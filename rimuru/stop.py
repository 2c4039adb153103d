"""`StopChecker`: whether a request ends after its newest token, and why (vLLM's finish and stop reasons).

Order: a stop token id or EOS ("stop"), then a stop string in the detokenised output ("stop"), then the length
limit ("length"). Nothing but the length limit applies before `min_tokens`.
"""

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
        text = self.text(request.output_token_ids, request.params.skip_special_tokens)
        return next((s for s in stops if s in text), None)  # checked every token: the first occurrence wins

    def text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def output_text(self, request: Request) -> str:
        """The output text, cut before the stop string that ended it."""
        text = self.text(request.output_token_ids, request.params.skip_special_tokens)
        if isinstance(request.stop_reason, str):
            text = text[: text.find(request.stop_reason)]
        return text
