"""Incremental detokenization gives exactly the text of decoding the whole output, a token at a time or in bursts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rimuru.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(family):
    return AutoTokenizer.from_pretrained(family[0])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_whole_decode(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=40))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids)), max_size=6)) | {len(ids)})
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces = [detok.update(ids[:cut]) for cut in cuts]
    pieces.append(detok.finish(ids))
    whole = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == detok.text == whole
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # half characters are held back until the end


def test_multibyte_characters_come_out_whole(tokenizer):
    ids = tokenizer.encode("naïve café 日本語 ok")
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == "naïve café 日本語 ok" and not any("\ufffd" in p for p in pieces)
