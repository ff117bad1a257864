"""Convert checkpoints: reshard megalite offline, or move to and from Hugging Face transformers.

    # reshard to another TP x PP layout (weights only; continue with --finetune or --no-load-optim)
    python tools/checkpoint/convert.py --model-type GPT --loader megalite --saver megalite \\
        --load-dir ckpt --save-dir ckpt_tp2pp2 --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

    # a Megatron-LM torch_dist (or torch) checkpoint, any TP/PP/EP it was saved on, to Hugging Face, streamed
    # tensor by tensor: memory stays near the largest tensor, not the model (docs/checkpoints.md)
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf --load-dir megatron_ckpt \\
        --save-dir hf_out --max-shard-size 5GB

    # export: a directory AutoModelForCausalLM / AutoTokenizer load (GPT2LMHeadModel, LlamaForCausalLM,
    # Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or GptOssForCausalLM)
    python tools/checkpoint/convert.py --model-type GPT --loader megalite --saver hf --load-dir ckpt --save-dir hf_out

    # a Megatron-LM torch_dist checkpoint (megatron-core's dist_checkpointing.load reads it into its GPTModel
    # at any TP/PP/EP; --target-tensor-parallel-size pads the vocabulary as Megatron-LM does for that TP)
    python tools/checkpoint/convert.py --model-type GPT --loader megalite --saver megatron --load-dir ckpt \
        --save-dir megatron_ckpt

    # import: a local directory of one of those (safetensors) as a megalite checkpoint
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megalite --load-dir hf_out \\
        --save-dir ckpt_from_hf --target-tensor-parallel-size 2

Only the model weights travel (no optimizer state). The mapping lives in megalite/checkpoint/hf/conversion.py
(configs and flags in hf/config.py, tokenizers in hf/tokenizer.py): GPT-2's gelu_new becomes --openai-gelu; a Llama's rope_theta and rope scaling (llama3, linear; read
from config.json in the transformers 4.x or 5.x layout) become --rotary-base, --use-rope-scaling
--rope-scaling-*, --rotary-seq-len-interpolation-factor; Qwen3's q_norm / k_norm become --qk-layernorm;
Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts, router and shared expert become --num-experts, --moe-*
and --add-qkv-bias (hf/moe.py); gpt-oss's sinks, sliding windows and clamped GLU become --softmax-type
learnable, --window-size / --window-attn-skip-freq and --quick-geglu --glu-linear-offset 1
--activation-func-clamp-value (hf/gpt_oss.py). The import prints the flags
to train on with.
--save-dir must be new or empty: nothing existing is overwritten. Bad input ends with one `error:`
line and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.arguments.parser import add_config_args, section_values  # noqa: E402
from megalite.checkpoint.hf import parse_size  # noqa: E402
from megalite.config import TokenizerConfig  # noqa: E402
from megalite.errors import ArgumentParser, InputError, cli  # noqa: E402

PROG = "tools/checkpoint/convert.py"


def get_args(argv=None):
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", required=True, choices=["GPT"])
    p.add_argument("--loader", required=True, choices=["megalite", "megatron", "hf"],
                   help="format of --load-dir (megalite also reads Megatron-LM's torch_dist and torch checkpoints; megatron: "
                   "Megatron-LM's only, with --saver hf streamed tensor by tensor)")
    p.add_argument("--saver", required=True, choices=["megalite", "hf", "megatron"],
                   help="format to write to --save-dir (megatron: Megatron-LM's torch_dist)")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True, help="a new (or empty) directory")
    p.add_argument("--target-tensor-parallel-size", type=int,
                   help="--saver megalite: TP of the written layout; --saver megatron: the TP whose "
                   "vocabulary padding to write (>= 1; default 1)")
    p.add_argument("--target-pipeline-parallel-size", type=int,
                   help="--saver megalite: PP of the written layout (>= 1; default 1)")
    add_config_args(p, TokenizerConfig, "tokenizer",
                    "tokenizer for --saver hf (default: as saved in the checkpoint's configuration)")
    p.add_argument("--no-tokenizer", action="store_true", help="--saver hf: write the model only")
    p.add_argument("--max-shard-size", default="5GB",
                   help="--loader megatron --saver hf: the largest safetensors file (transformers' spelling: "
                   "5GB, 500MB, 2GiB or bytes; default 5GB); more than one file gets model.safetensors.index.json")
    args = p.parse_args(argv)
    args.tokenizer = section_values(args, "tokenizer")  # the overrides of the saved tokenizer
    if args.loader == "hf" and args.saver == "hf":
        p.error("--loader hf --saver hf: nothing to convert")
    if args.saver == "hf" and (args.target_tensor_parallel_size or args.target_pipeline_parallel_size):
        p.error("--target-tensor/pipeline-parallel-size apply to --saver megalite only")
    if args.saver == "megatron" and args.target_pipeline_parallel_size:
        p.error("--target-pipeline-parallel-size: a torch_dist checkpoint loads on any PP; drop it")
    for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not os.path.isdir(args.load_dir):
        p.error(f"--load-dir {args.load_dir}: directory not found")
    if os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
        p.error(f"--save-dir {args.save_dir} exists and is not a directory: choose a new directory "
                "(nothing is overwritten)")
    if os.path.isdir(args.save_dir) and os.listdir(args.save_dir):
        p.error(f"--save-dir {args.save_dir} is not empty: choose a new directory (nothing is overwritten)")
    if os.path.realpath(args.save_dir) == os.path.realpath(args.load_dir):
        p.error("--save-dir is --load-dir: choose a new directory (nothing is overwritten)")
    try:
        args.max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        p.error(f"--max-shard-size: {e}")
    if args.max_shard_size != "5GB" and not (args.loader == "megatron" and args.saver == "hf"):
        p.error("--max-shard-size applies to --loader megatron --saver hf only")
    if args.no_tokenizer and args.tokenizer:
        p.error("--no-tokenizer writes no tokenizer: drop the tokenizer flags, or --no-tokenizer")
    return args


def check_layout(cfg: dict, tp: int, pp: int) -> None:
    """Refuse a target layout the model cannot be split into, naming the flag."""
    for what, n in (("--num-attention-heads", cfg["num_attention_heads"]),
                    ("--num-query-groups", cfg.get("num_query_groups") or cfg["num_attention_heads"]),
                    ("--ffn-hidden-size", cfg["ffn_hidden_size"]),
                    ("--moe-ffn-hidden-size", cfg.get("moe_ffn_hidden_size") if cfg.get("num_experts") else None),
                    ("--moe-shared-expert-intermediate-size", cfg.get("moe_shared_expert_intermediate_size"))):
        if n and n % tp:
            raise InputError(f"--target-tensor-parallel-size {tp} does not divide the model's {what} ({n})")
    if cfg["num_layers"] % pp:
        raise InputError(f"--target-pipeline-parallel-size {pp} does not divide the model's --num-layers "
                         f"({cfg['num_layers']})")


def _save_megatron(save_dir: str, state: dict, cfg: dict, saved: dict, iteration: int, tp: int) -> int:
    """--saver megatron: a torch_dist checkpoint, the vocabulary padded as Megatron-LM pads it for TP `tp`."""
    from megalite.checkpoint.megatron import write_megatron_checkpoint
    from megalite.model import pad_vocab_size
    divisible_by = cfg.get("make_vocab_size_divisible_by") or saved.get("model", {}).get(
        "make_vocab_size_divisible_by") or 128
    padded = pad_vocab_size(cfg["vocab_size"], int(divisible_by), tp)
    check_layout(cfg, tp, 1)
    where = write_megatron_checkpoint(save_dir, state, cfg, saved, iteration, padded)
    print(f"wrote {where} (Megatron-LM torch_dist, vocabulary padded to {padded} rows for TP {tp}; weights only: "
          "continue in Megatron-LM with --finetune or --no-load-optim)")
    return 0


def _check_megatron(load_dir: str) -> None:
    from megalite.checkpoint.files import inspect_checkpoint
    if not inspect_checkpoint(load_dir, "--load-dir").get("megatron"):
        raise InputError(f"--loader megatron: --load-dir {load_dir} is a megalite checkpoint; use --loader megalite")


def _megatron_to_hf(args) -> int:
    """--loader megatron --saver hf: streamed, one tensor (one layer) in memory at a time."""
    from megalite.checkpoint.hf import HF_CLASSES
    from megalite.checkpoint.megatron import megatron_to_hf
    arch, tok, files = megatron_to_hf(args.load_dir, args.save_dir, args.tokenizer, not args.no_tokenizer,
                                      args.max_shard_bytes)
    print(f"wrote {args.save_dir}: {HF_CLASSES[arch]} in {len(files)} safetensors file{'s' * (len(files) > 1)}"
          f"{' and ' + tok.name + ' tokenizer' if tok else ''}")
    return 0


@cli(PROG)
def main(argv=None) -> int:
    args = get_args(argv)
    from megalite.checkpoint.files import inspect_checkpoint
    from megalite.checkpoint.offline import load_full_state_dict, save_full_state_dict
    from megalite.checkpoint.hf import HF_CLASSES, from_hf, pretrain_flags, to_hf
    from megalite.config import RunConfig, from_saved

    tp, pp = args.target_tensor_parallel_size or 1, args.target_pipeline_parallel_size or 1
    if args.loader == "megatron":
        _check_megatron(args.load_dir)
        if args.saver == "hf":
            return _megatron_to_hf(args)
    if args.loader in ("megalite", "megatron"):
        inspect_checkpoint(args.load_dir, "--load-dir")  # one-line errors naming a missing or corrupt file
        meta, state = load_full_state_dict(args.load_dir)
        if args.saver == "hf":
            tokenizer = None
            if not args.no_tokenizer:
                from megalite.checkpoint.hf.tokenizer import exportable
                from megalite.data.saved_tokenizer import build_tokenizer_for
                tokenizer = exportable(build_tokenizer_for(meta, args.tokenizer), args.load_dir)
            arch = to_hf(meta, state, args.save_dir, tokenizer)
            print(f"wrote {args.save_dir}: {HF_CLASSES[arch]}"
                  f"{' and ' + tokenizer.name + ' tokenizer' if tokenizer else ''}")
            return 0
        cfg, saved = meta["model_config"], from_saved(meta)
        if args.saver == "megatron":
            return _save_megatron(args.save_dir, state, cfg, saved, int(meta["iteration"]), tp)
        check_layout(cfg, tp, pp)
        saved = {**saved, "parallel": dict(saved.get("parallel", {}), tensor_model_parallel_size=tp,
                                           pipeline_model_parallel_size=pp)}
        saved = RunConfig.from_dict(saved).to_dict()  # a record of version 1 becomes one of version 2
        where = save_full_state_dict(args.save_dir, state, cfg, saved, int(meta["iteration"]), tp, pp)
        print(f"wrote {where} (TP {tp} x PP {pp}, weights only: continue with --finetune or --no-load-optim)")
        return 0
    cfg, saved, state = from_hf(args.load_dir)
    if args.saver == "megatron":
        return _save_megatron(args.save_dir, state, cfg, saved, 0, tp)
    check_layout(cfg, tp, pp)
    saved["parallel"].update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    where = save_full_state_dict(args.save_dir, state, cfg, saved, 0, tp, pp)
    tokenizer = saved["tokenizer"]
    tok = (" --tokenizer-type HuggingFaceTokenizer --tokenizer-model " + shlex.quote(tokenizer["tokenizer_model"])
           if tokenizer["tokenizer_type"] else "")
    print(f"wrote {where} (TP {tp} x PP {pp}). Continue training with:\n  pretrain_gpt.py --load "
          f"{shlex.quote(args.save_dir)} --finetune --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
          f"{shlex.join(pretrain_flags(cfg))}{tok} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
