"""Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh runs on megalite:
examples/megatron/mixtral_cpu.sh passes its flag set as written (sizes, paths and parallel sizes
aside), on data preprocessed with its Llama2Tokenizer (bos before each document), and it trains on
2 CPU ranks (EP 2); its two flags without a megalite counterpart are honoured: --no-position-embedding
changes nothing with RoPE (refused otherwise, as Megatron-LM), --no-masked-softmax-fusion gets a
notice. The helpers are tests/test_megatron_examples.py's."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from dist_helpers import ROOT, run_pretrain, train_losses
from test_megatron_examples import PATHS, PY, SIZES, argv_of, flags_of
from megalite.arguments import ArgumentError, parse_args, validate_args

SCRIPT = os.path.join(ROOT, "examples", "megatron", "mixtral_cpu.sh")

# The script's flags and values as Megatron-LM's main branch writes them (commit 9b8acfd; paths as
# placeholders; --wandb-* only with WANDB_API_KEY set)
MIXTRAL_8X7B = {
    "--use-mcore-models": "", "--disable-bias-linear": "", "--seq-length": "4096", "--max-position-embeddings": "32768",
    "--num-layers": "32", "--hidden-size": "4096", "--ffn-hidden-size": "14336", "--num-attention-heads": "32",
    "--init-method-std": "0.01", "--attention-dropout": "0.0", "--hidden-dropout": "0.0", "--normalization": "RMSNorm",
    "--position-embedding-type": "rope", "--swiglu": "", "--untie-embeddings-and-output-weights": "",
    "--group-query-attention": "", "--num-query-groups": "8", "--no-masked-softmax-fusion": "",
    "--no-position-embedding": "", "--rotary-base": "1000000",
    "--num-experts": "8", "--moe-router-topk": "2", "--moe-router-load-balancing-type": "aux_loss",
    "--moe-aux-loss-coeff": "1e-2", "--moe-grouped-gemm": "", "--moe-token-dispatcher-type": "alltoall",
    "--overlap-param-gather": "", "--overlap-grad-reduce": "",
    "--tokenizer-type": "Llama2Tokenizer", "--tokenizer-model": "tok", "--data-path": "DATA", "--split": "99990,8,2",
    "--micro-batch-size": "1", "--global-batch-size": "256", "--lr": "1e-4", "--train-iters": "500000",
    "--lr-decay-iters": "320000", "--lr-decay-style": "cosine", "--min-lr": "1.0e-5", "--weight-decay": "0.1",
    "--lr-warmup-iters": "500", "--clip-grad": "1.0", "--bf16": "",
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "4", "--expert-model-parallel-size": "8",
    "--use-distributed-optimizer": "", "--sequence-parallel": "",
    "--log-interval": "1", "--save-interval": "10000", "--eval-interval": "1000", "--eval-iters": "10",
    "--save": "ckpt", "--load": "ckpt", "--tensorboard-dir": "ckpt/tensorboard", "--no-load-optim": "",
    "--no-load-rng": "",
}
MOE_SIZES = {"--expert-model-parallel-size", "--lr-warmup-iters"}


def command(*args) -> dict:
    proc = subprocess.run(["bash", SCRIPT, *args], env=dict(os.environ, DRY_RUN="1", PYTHON=PY), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "pretrain_gpt.py" in ln]
    argv = line.split()
    return flags_of(argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")) + 1:])


def test_flag_set_is_megatron_lms_with_sizes_shrunk():
    ours = command("ckpt", "tok", "DATA")
    assert set(ours) == set(MIXTRAL_8X7B)
    for flag, value in ours.items():
        if flag not in SIZES | PATHS | MOE_SIZES:
            assert value.replace("\\", "") == MIXTRAL_8X7B[flag], flag
    assert ours["--expert-model-parallel-size"] == "2" and ours["--pipeline-model-parallel-size"] == "1"


def test_no_position_embedding_is_refused_without_rope():
    argv = argv_of({f: v for f, v in MIXTRAL_8X7B.items() if f not in ("--tokenizer-model", "--data-path")},
                   **{"--mock-data": "", "--tokenizer-type": None, "--vocab-size": "1024", "--split": None,
                      "--position-embedding-type": "learned_absolute"})
    with pytest.raises(ArgumentError, match="--no-position-embedding is deprecated, use --position-embedding-type"):
        validate_args(parse_args(argv), 64, check_files=False)


# Megatron-LM's --split 99990,8,2 gives the test split round(2e-5 x N) documents: N > 25000 for one
NUM_DOCS = 26000


@pytest.fixture(scope="module")
def llama2_data(corpus, tmp_path_factory):
    """26000 documents of two consecutive paragraphs of the bundled corpus, cycled, preprocessed
    with Llama2Tokenizer and the corpus fixture's SentencePiece model (unk 0, bos 1, eos 2)."""
    tmp = tmp_path_factory.mktemp("llama2-data")
    model = corpus[corpus.index("--tokenizer-model") + 1]
    with open(os.path.join(ROOT, "data", "corpus.jsonl")) as f:
        paragraphs = [p for line in f for p in json.loads(line)["text"].split("\n\n") if p.strip()]
    with open(tmp / "docs.jsonl", "w") as f:
        for i in range(NUM_DOCS):
            text = paragraphs[i % len(paragraphs)] + "\n\n" + paragraphs[(i + 1) % len(paragraphs)]
            f.write(json.dumps({"text": text}) + "\n")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                    str(tmp / "docs.jsonl"), "--output-prefix", str(tmp / "llama2"), "--tokenizer-type", "Llama2Tokenizer",
                    "--tokenizer-model", model, "--append-eod"], env=dict(os.environ, PYTHONPATH=ROOT), check=True,
                   capture_output=True, text=True, timeout=300)
    return model, str(tmp / "llama2_text_document")


def test_llama2_tokenizer_puts_bos_before_each_document(llama2_data):
    from megalite.data.indexed_dataset import IndexedDataset
    ds = IndexedDataset(llama2_data[1])
    docs = [np.asarray(ds[i]) for i in range(5)]
    assert all(d[0] == 1 and d[-1] == 2 and 1 not in d[1:] for d in docs)  # bos, the text, eod (eos)


def test_script_trains_on_two_cpu_ranks(llama2_data, tmp_path):
    model, data = llama2_data
    flags = command(str(tmp_path / "ckpt"), model, data)
    records, proc = run_pretrain(2, argv_of(flags, **{"--split": "99990,8,2"}), tmp_path)
    train = [r for r in records if "consumed_samples" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(math.isfinite(x) for x in train_losses(records))
    assert {r["split"] for r in records if "split" in r} == {"valid", "test"}  # the 8 and 2 of 99990,8,2
    assert "--no-masked-softmax-fusion: a Megatron-LM kernel choice" in proc.stdout
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000004" / "metadata.json")
