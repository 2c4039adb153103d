"""Schemathesis against the served OpenAPI document: generated valid and invalid requests for every operation,
no 5xx, and every error in OpenAI's shape. Generation is kept short (max_tokens and n clamped) so it runs fast."""

import itertools

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

EXAMPLES = {GenerationMode.POSITIVE: 100, GenerationMode.NEGATIVE: 60}
MIN_CASES = 300


def _clamp(case, counter) -> None:
    """Keep generations tiny and send the served model's name in two cases out of three."""
    body = case.body if isinstance(case.body, dict) else None
    if body is None:
        return
    for field, limit in (("max_tokens", 8), ("max_completion_tokens", 8), ("min_tokens", 8), ("n", 3)):
        if isinstance(body.get(field), int) and not isinstance(body[field], bool) and body[field] > limit:
            body[field] = limit
    if next(counter) % 3 and isinstance(body.get("model"), str):
        body["model"] = "tiny-qwen-moe"


def _check(response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


def test_generated_requests(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    names = {f"{op.method.upper()} {op.path}" for op in operations}
    assert names >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /metrics"}
    counter, num_cases, statuses = itertools.count(), [0], {}
    for operation, (mode, examples) in itertools.product(operations, EXAMPLES.items()):
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to break in a GET without parameters

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            _clamp(case, counter)
            response = case.call(base_url=server.url, timeout=60)
            num_cases[0] += 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            _check(response)

        run()
    print(f"schemathesis: {num_cases[0]} cases, statuses {statuses}")
    assert num_cases[0] >= MIN_CASES, (num_cases[0], statuses)
    assert statuses.get(200, 0) >= 50 and statuses.get(400, 0) >= 50, statuses  # both paths were exercised
