"""A distribution-shift stream for the adjusters: the first half of a JSONL request stream (by arrival) keeps its
prompts in the first part of the vocabulary, the second half moves to the second part. With dummy weights of
`router_regimes=2` (rimuru.models.dummy) every MoE layer's popular experts move with the prompts halfway through.

    python -m tools.engine.shift_stream stream.jsonl --vocab-size 151936 > shifted.jsonl
"""

import argparse
import json
import sys

from rimuru.models.dummy import regime_rows


def shift(requests: list[dict], vocab_size: int) -> list[dict]:
    parts = regime_rows(vocab_size, 2)
    ordered = sorted(requests, key=lambda r: r["arrival"])
    out = []
    for i, request in enumerate(ordered):
        part = parts[0] if i < len(ordered) // 2 else parts[1]
        width = part.stop - part.start
        out.append(dict(request, prompt_token_ids=[part.start + t % width for t in request["prompt_token_ids"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stream")
    parser.add_argument("--vocab-size", type=int, required=True)
    args = parser.parse_args()
    with open(args.stream) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    for request in shift(requests, args.vocab_size):
        sys.stdout.write(json.dumps(request) + "\n")


if __name__ == "__main__":
    main()
