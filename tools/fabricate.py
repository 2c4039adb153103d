"""Write a tiny random Qwen MoE checkpoint (config, safetensors, tokenizer) that transformers and Rimuru both load.

    python tools/fabricate.py /tmp/tiny-qwen2-moe --arch qwen2_moe --seed 0
"""

import argparse

from rimuru.models.fabricate import EXPERT_LAYOUTS, fabricate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=("qwen2_moe", "qwen3_moe"), default="qwen2_moe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--mlp-only-layers", type=int, nargs="*", default=[])
    parser.add_argument("--expert-layout", choices=EXPERT_LAYOUTS, default="per_expert")
    parser.add_argument("--prefix", default="model.", help='"model." or "model.language_model."')
    parser.add_argument("--num-shards", type=int, default=1)
    args = parser.parse_args(argv)
    out = fabricate(
        args.out_dir,
        arch=args.arch,
        seed=args.seed,
        num_layers=args.num_layers,
        mlp_only_layers=tuple(args.mlp_only_layers),
        expert_layout=args.expert_layout,
        prefix=args.prefix,
        num_shards=args.num_shards,
    )
    print(out)


if __name__ == "__main__":
    main()
