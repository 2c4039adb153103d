"""Write a tiny random Qwen MoE checkpoint (config, safetensors, tokenizer) that transformers and Rimuru both load.

    python tools/fabricate.py /tmp/tiny-qwen2-moe --arch qwen2_moe --seed 0

The same as `rimuru fabricate`; every flag of that command works here.
"""

import sys

from rimuru.serving.cli import main

if __name__ == "__main__":
    sys.exit(main(["fabricate", *sys.argv[1:]]))
