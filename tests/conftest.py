import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _grad_mode_is_restored():
    """A test that switches autograd off globally would silently break the tests after it."""
    import torch
    yield
    assert torch.is_grad_enabled(), "this test left torch.set_grad_enabled(False) behind"


CORPUS_DOCS = 600  # ~140k tokens: enough for many epochs-free runs of a few dozen iterations
CORPUS_VOCAB = 512  # SentencePiece needs ~310 pieces for the corpus's characters and bytes;
# 512 is also a multiple of 128 x TP for TP <= 4, so the padded vocabulary (and with it the
# shape of every embedding in a checkpoint) is the same on every layout


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """pretrain_gpt.py data flags for real text on which a tiny GPT's loss falls within a few
    iterations (random mock tokens pin it at ln V whatever the weights do, so they cannot tell a
    layout that trains from one that does not). Built once per session from the bundled
    data/corpus.jsonl with the project's own tools, in a temporary directory (not ../shared, not
    data/build): a SentencePiece BPE tokenizer of CORPUS_VOCAB pieces and a Megatron .bin/.idx."""
    tmp = tmp_path_factory.mktemp("corpus")
    subset = tmp / "corpus.jsonl"
    with open(os.path.join(ROOT, "data", "corpus.jsonl")) as src, open(subset, "w") as dst:
        for _, line in zip(range(CORPUS_DOCS), src):
            dst.write(line)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")

    def tool(*argv):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", argv[0]), *map(str, argv[1:])],
                       env=env, check=True, capture_output=True, text=True)

    tool("train_tokenizer.py", "--input", subset, "--model-prefix", tmp / "tokenizer",
         "--vocab-size", CORPUS_VOCAB, "--model-type", "bpe", "--num-threads", "1")
    tool("preprocess_data.py", "--input", subset, "--output-prefix", tmp / "corpus",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp / "tokenizer.model", "--append-eod")
    return ["--data-path", str(tmp / "corpus_text_document"), "--split", "98,2,0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp / "tokenizer.model"),
            "--data-cache-path", str(tmp / "index-cache")]
