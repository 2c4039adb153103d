"""`LLM`: the offline API, vLLM's shape: `LLM(model, ...).generate(prompts, sampling_params)`."""

from typing import Self

from tqdm.auto import tqdm

from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.outputs import CompletionOutput, RequestOutput
from rimuru.request import Request
from rimuru.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_options):
        """`engine_options` are `EngineConfig` fields: device, dtype, gpu_memory_budget, load_format, ..."""
        self.engine = Engine(EngineConfig(model=str(model), **engine_options))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Give the engine's GPU and pinned host memory back now (`Engine.close`); `with LLM(...) as llm:` does it
        on leaving the block."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`; every prompt is validated before any is queued."""
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        for prompt, p in zip(prompts, params):
            self.engine.validate(prompt, p)  # all first: a bad prompt leaves nothing half-queued
        groups = [self._add(prompt, p) for prompt, p in zip(prompts, params)]
        self._run(sum(len(g[1]) for g in groups), use_tqdm)
        return [self._output(prompt, request_id, sequences) for prompt, (request_id, sequences) in zip(prompts, groups)]

    def _add(self, prompt, params: SamplingParams) -> tuple[str, list[Request]]:
        request_id, self._next_id = str(self._next_id), self._next_id + 1
        return request_id, self.engine.add_request(request_id, prompt, params)

    def _run(self, num_sequences: int, use_tqdm: bool) -> None:
        with tqdm(total=num_sequences, desc="Generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(r.is_finished for r in self.engine.step()))

    def _output(self, prompt, request_id: str, sequences: list[Request]) -> RequestOutput:
        checker = self.engine.stop_checker
        outputs = [
            CompletionOutput(
                index=i,
                text=checker.output_text(seq),
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs,
                cumulative_logprob=sum(lp[t] for lp, t in zip(seq.logprobs, seq.output_token_ids)) if seq.logprobs else None,
            )
            for i, seq in enumerate(sequences)
        ]
        text_prompt = prompt if isinstance(prompt, str) else None
        return RequestOutput(request_id, text_prompt, sequences[0].prompt_token_ids, outputs, finished=True)
