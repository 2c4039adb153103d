"""A small byte-level BPE tokenizer trained offline on a fixed English text, for fabricated checkpoints.

Owns the training text, the special tokens and the ChatML chat template; `fabricate` saves the result beside the
weights so `AutoTokenizer.from_pretrained` works with no network. Not a tokenizer for real models.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving engine answers many requests at once, and each request
asks the model for the next word, then the next, until it reaches the end of its answer or its length limit.
Mixture-of-experts models route every token to a few experts out of many. The router scores the experts, keeps
the best ones, and mixes their outputs by weight. Most experts sit idle for any single token, so their weights
can wait in host memory while the popular ones stay on the graphics card.
Once upon a time there was a small town by the sea. The people of the town fished in the morning, mended their
nets in the afternoon, and told stories in the evening. Children ran along the harbour wall and counted boats.
In the spring the fields turned green, in the summer the hills turned gold, and in the autumn the wind carried
the smell of apples and wood smoke down every street. Winter brought long nights, bright stars and quiet snow.
What is the capital of France? Paris is the capital of France. What is two plus two? Two plus two is four.
How are you today? I am well, thank you, and how are you? Please write a short poem about the moon and the sea.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, 0 1 2 3 4 5 6 7 8 9 10 100.
Memory is a pool of pages. Some pages hold experts, some pages hold the attention cache, and the split between
them follows the queue of requests. When many requests wait, experts leave; when the queue is short, they return.
Science asks questions about the world and tests the answers with careful experiments and honest measurements.
Good code reads like good prose: short sentences, clear names, and no surprise hidden behind a friendly face.
"""


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2/Qwen style) with at most `vocab_size` tokens, the special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
