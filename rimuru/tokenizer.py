"""The checkpoint's text side: its tokenizer (None when it ships none: prompts are then token ids) and the EOS ids
that end a sequence."""

import json
import os

from rimuru.models import ModelConfig


def load_tokenizer(path: str):
    """Hugging Face's tokenizer of the folder `path`, or None when it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(folder: str, config: ModelConfig) -> set[int]:
    """EOS ids of config.json and generation_config.json together (chat models end turns with the latter)."""
    ids = set(config.eos_token_id)
    path = os.path.join(folder, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
