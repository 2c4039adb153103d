"""`SamplingParams`: how one request is sampled and when it stops, with vLLM's names and defaults.

Owns validation: a bad value raises ValueError naming the field and its allowed range, before anything is queued.
"""

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature is greedy (logits / 1e-300 would overflow)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # below 1e-5 (0 included) means greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely), [0, 1]
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0  # stop conditions are ignored before this many tokens
    stop: tuple[str, ...] = ()  # strings that end the output (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the output (included in token_ids)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities to return per token (the sampled one is added)
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _check("n", self.n, self.n >= 1, "an integer >= 1")
        _check("temperature", self.temperature, self.temperature >= 0, ">= 0")
        _check("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]")
        _check("top_k", self.top_k, self.top_k >= 0, "-1, 0 (all tokens) or a positive integer")
        _check("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]")
        if self.max_tokens is not None:
            _check("max_tokens", self.max_tokens, self.max_tokens >= 1, "an integer >= 1")
        _check("min_tokens", self.min_tokens, self.min_tokens >= 0, ">= 0")
        if self.max_tokens is not None:
            _check("min_tokens", self.min_tokens, self.min_tokens <= self.max_tokens, "<= max_tokens")
        if self.logprobs is not None:
            _check("logprobs", self.logprobs, 0 <= self.logprobs <= 20, "in [0, 20]")
        if any(not s for s in self.stop):
            raise ValueError("stop: strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
