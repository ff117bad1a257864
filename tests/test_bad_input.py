"""Bad input never crashes and never destroys anything.

Each case runs a real entry point (pretrain_gpt.py or a tool) as a process of its own (forked from
one that has imported torch: fork_runner.py) on its copy of one directory of good and broken
files, and checks that it
  - exits with status 2,
  - prints exactly one line containing `error:`, which names the culprit flag or file,
  - prints no traceback,
  - leaves every file of the directory as it was (and creates none).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dist_helpers import ROOT, run_pretrain
from fork_runner import ForkRunner

from megalite.data.indexed_dataset import IndexedDatasetBuilder, write_index
from tiny import tiny

PY = sys.executable
TINY = tiny(seq_length=16, global_batch_size=None, train_iters=1, eval_iters=0)
MOCK = ["--mock-data", "--vocab-size", "100"] + TINY
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
DATA = ["--data-path", "data/good_text_document"] + NULL + TINY


def _write_dataset(prefix: str, docs, dtype=np.uint16) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for d in docs:
        builder.add_document(np.asarray(d, dtype=dtype))
    builder.finalize(prefix + ".idx")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    return env


def _run(tool: str, args: list[str], cwd: str, timeout: float = 120.0, nproc: int = 1,
         launcher: str = "torch.distributed.run"):
    env = _env()
    launcher = [PY] if nproc == 1 else [PY, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + [os.path.join(ROOT, tool), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _tree(root: str) -> dict[str, str]:
    """relative path -> sha256 of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One directory of good and broken inputs, shared by every case (read-only for them)."""
    root = str(tmp_path_factory.mktemp("bad_input"))
    p = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    os.makedirs(p("data"))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, 40) for _ in range(30)]
    _write_dataset(p("data", "good_text_document"), docs)
    # truncated .bin: the index addresses more bytes than there are
    shutil.copy(p("data", "good_text_document.idx"), p("data", "trunc_text_document.idx"))
    with open(p("data", "good_text_document.bin"), "rb") as f:
        data = f.read()
    with open(p("data", "trunc_text_document.bin"), "wb") as f:
        f.write(data[: len(data) // 2])
    # garbage .idx
    shutil.copy(p("data", "good_text_document.bin"), p("data", "garbage_text_document.bin"))
    with open(p("data", "garbage_text_document.idx"), "wb") as f:
        f.write(rng.bytes(200))
    # a float "token" dataset, well formed
    lengths = np.full(4, 10)
    np.zeros(40, np.float32).tofile(p("data", "float_text_document.bin"))
    write_index(p("data", "float_text_document.idx"), np.float32, lengths, np.arange(5))
    # ids beyond a 100-token vocabulary (made with another tokenizer)
    _write_dataset(p("data", "bigids_text_document"), [rng.integers(0, 5000, 40) for _ in range(30)])
    # tokenizer files that exist but are not what they claim
    with open(p("garbage.model"), "wb") as f:
        f.write(rng.bytes(300))
    with open(p("vocab.json"), "w") as f:
        f.write("{not json")
    with open(p("merges.txt"), "w") as f:
        f.write("#version: 0.2\na b\n")
    # a plain file where a directory is expected, and a directory with someone's data in it
    with open(p("notes.txt"), "w") as f:
        f.write("precious\n")
    os.makedirs(p("busy"))
    with open(p("busy", "keep.txt"), "w") as f:
        f.write("precious\n")
    # a Hugging Face directory whose config is garbage
    os.makedirs(p("hf_bad"))
    with open(p("hf_bad", "config.json"), "w") as f:
        f.write("{\"model_type\": ")
    # JSONL inputs
    with open(p("corpus.jsonl"), "w") as f:
        f.write(json.dumps({"text": "1 2 3"}) + "\n" + json.dumps({"text": "4 5000"}) + "\n")
    with open(p("bad.jsonl"), "w") as f:
        f.write(json.dumps({"text": "hello world"}) + "\nnot json\n")
    # Megatron-LM checkpoints (the same tracker and iteration names as megalite's): torch and torch_dist
    for name, files in (("ck_megatron_torch", {"mp_rank_00/model_optim_rng.pt": ""}),
                        ("ck_megatron_dist", {"metadata.json": '{"sharded_backend": "torch_dist"}', "__0_0.distcp": "",
                                              "common.pt": ""})):
        for rel, text in files.items():
            os.makedirs(os.path.dirname(p(name, "iter_0000005", rel)), exist_ok=True)
            with open(p(name, "iter_0000005", rel), "w") as f:
                f.write(text)
        with open(p(name, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")
    # corrupt and truncated compressed / columnar inputs
    lines = "".join(json.dumps({"text": "1 2 3"}) + "\n" for _ in range(200)).encode()
    packed = gzip.compress(lines)
    with open(p("trunc.jsonl.gz"), "wb") as f:
        f.write(packed[: len(packed) // 2])
    with open(p("garbage.jsonl.gz"), "wb") as f:
        f.write(b"\x1f\x8b" + rng.bytes(100))
    with open(p("garbage.jsonl.zst"), "wb") as f:
        f.write(b"\x28\xb5\x2f\xfd" + rng.bytes(100))
    with open(p("garbage.parquet"), "wb") as f:
        f.write(b"PAR1" + rng.bytes(100) + b"PAR1")
    with open(p("tok.model"), "wb") as f:  # stands for an existing train_tokenizer.py output
        f.write(b"existing")
    # a real checkpoint, and broken copies of it
    # on the session's pool of ready ranks (the same main(argv)): a fresh process would pay torch's import again
    run_pretrain(1, MOCK + ["--save", "ck"], root, "ck-run")
    ck_iter = p("ck", "iter_0000001")
    for name, breaks in [("ck_badmeta", "iter_0000001/metadata.json"), ("ck_badtracker", None),
                         ("ck_norank", "iter_0000001/rank_00000.safetensors"), ("ck_badindex", "iter_0000001/index.jsonl"),
                         ("ck_truncrank", "iter_0000001/rank_00000.safetensors")]:
        shutil.copytree(p("ck"), p(name))
        if name == "ck_badtracker":
            with open(p(name, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("latest\n")
        elif name == "ck_norank":
            os.remove(p(name, breaks))
        elif name == "ck_truncrank":  # a save cut short: half the rank's file
            with open(p(name, breaks), "rb") as f:
                data = f.read()
            with open(p(name, breaks), "wb") as f:
                f.write(data[: len(data) // 2])
        else:
            with open(p(name, breaks), "w") as f:
                f.write("{\"truncated\": ")
    assert os.path.isdir(ck_iter)
    return root


G = "tools/generate.py"
C = "tools/checkpoint/convert.py"
P = "tools/preprocess_data.py"
T = "tools/train_tokenizer.py"
CONVERT = ["--model-type", "GPT", "--loader", "megalite", "--saver", "megalite"]

# (id, entry point, arguments, what the error line must name)
CASES = [
    # -- pretrain_gpt.py: one flag out of range ------------------------------------------------------
    ("train-iters-0", "pretrain_gpt.py", MOCK + ["--train-iters", "0"], "--train-iters must be an integer >= 1"),
    ("micro-batch-0", "pretrain_gpt.py", MOCK + ["--micro-batch-size", "0"], "--micro-batch-size must be"),
    ("lr-negative", "pretrain_gpt.py", MOCK + ["--lr", "-1"], "--lr must be a number > 0"),
    ("lr-nan", "pretrain_gpt.py", MOCK + ["--lr", "nan"], "--lr must be"),
    ("dropout-1", "pretrain_gpt.py", MOCK + ["--hidden-dropout", "1"], "--hidden-dropout must be a probability"),
    ("beta2-1", "pretrain_gpt.py", MOCK + ["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1)"),
    ("eps-0", "pretrain_gpt.py", MOCK + ["--adam-eps", "0"], "--adam-eps must be a number > 0"),
    ("clip-negative", "pretrain_gpt.py", MOCK + ["--clip-grad", "-1"], "--clip-grad must be"),
    ("weight-decay-negative", "pretrain_gpt.py", MOCK + ["--weight-decay", "-0.1"], "--weight-decay must be"),
    ("rotary-percent-0", "pretrain_gpt.py", MOCK + ["--position-embedding-type", "rope", "--rotary-percent", "0"],
     "--rotary-percent must be in (0, 1]"),
    ("seed-negative", "pretrain_gpt.py", MOCK + ["--seed", "-1"], "--seed must be"),
    ("eval-iters-negative", "pretrain_gpt.py", MOCK + ["--eval-iters", "-1"], "--eval-iters must be"),
    ("num-layers-missing", "pretrain_gpt.py", MOCK[:3] + MOCK[5:], "--num-layers is required"),
    ("unknown-flag", "pretrain_gpt.py", MOCK + ["--no-such-flag"], "--no-such-flag"),
    ("wsd-iters-without-wsd", "pretrain_gpt.py", MOCK + ["--lr-wsd-decay-iters", "1"], "--lr-wsd-decay-iters"),
    ("split-unparseable", "pretrain_gpt.py", DATA + ["--split", "90,x,10"], "--split"),
    # -- pretrain_gpt.py: flags that would do nothing with --mock-data --------------------------------
    ("mock-eod-mask-loss", "pretrain_gpt.py", MOCK + ["--eod-mask-loss"], "--eod-mask-loss has no effect with --mock-data"),
    ("mock-reset-position-ids", "pretrain_gpt.py", MOCK + ["--reset-position-ids"], "--reset-position-ids"),
    # -- pretrain_gpt.py: tokenizers -------------------------------------------------------------------
    ("tokenizer-type-unknown", "pretrain_gpt.py", MOCK + ["--tokenizer-type", "BertWordPieceLowerCase"], "--tokenizer-type"),
    ("null-tokenizer-no-vocab", "pretrain_gpt.py", ["--mock-data", "--tokenizer-type", "NullTokenizer"] + TINY,
     "NullTokenizer needs --vocab-size"),
    # Megatron-LM's default --tokenizer-type GPT2BPETokenizer reads a vocabulary and merges
    ("vocab-file-without-merge-file", "pretrain_gpt.py", MOCK + ["--vocab-file", "vocab.json"],
     "GPT2BPETokenizer needs --merge-file"),
    ("merge-file-for-sentencepiece", "pretrain_gpt.py",
     ["--data-path", "data/good_text_document", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
      "garbage.model", "--merge-file", "merges.txt"] + TINY, "--merge-file is not read by"),
    ("tokenizer-model-missing", "pretrain_gpt.py",
     ["--data-path", "data/good_text_document", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
      "nope.model"] + TINY, "--tokenizer-model nope.model"),
    ("tokenizer-model-garbage", "pretrain_gpt.py",
     ["--data-path", "data/good_text_document", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
      "garbage.model"] + TINY, "--tokenizer-model garbage.model: not a SentencePiece model"),
    # -- pretrain_gpt.py: datasets ---------------------------------------------------------------------
    ("data-missing", "pretrain_gpt.py", ["--data-path", "data/nope_text_document"] + NULL + TINY,
     "data/nope_text_document.bin"),
    ("data-bin-truncated", "pretrain_gpt.py", ["--data-path", "data/trunc_text_document"] + NULL + TINY,
     "trunc_text_document.bin"),
    ("data-idx-garbage", "pretrain_gpt.py", ["--data-path", "data/garbage_text_document"] + NULL + TINY,
     "garbage_text_document.idx"),
    ("data-float-dtype", "pretrain_gpt.py", ["--data-path", "data/float_text_document"] + NULL + TINY,
     "float32 tokens"),
    ("data-ids-beyond-vocab", "pretrain_gpt.py", ["--data-path", "data/bigids_text_document"] + NULL + TINY,
     "bigids_text_document.bin is outside the model's vocabulary"),
    ("blend-weight-negative", "pretrain_gpt.py", ["--data-path", "-1", "data/good_text_document", "1",
                                                  "data/good_text_document"] + NULL + TINY, "--data-path"),
    # -- pretrain_gpt.py: checkpoints ------------------------------------------------------------------
    ("save-is-a-file", "pretrain_gpt.py", MOCK + ["--save", "notes.txt"], "--save notes.txt exists"),
    ("log-jsonl-under-a-file", "pretrain_gpt.py", MOCK + ["--log-jsonl", "notes.txt/run.jsonl"],
     "--log-jsonl notes.txt/run.jsonl"),
    ("save-over-other-run", "pretrain_gpt.py", MOCK + ["--save", "ck"], "--save ck already holds checkpoints"),
    ("load-corrupt-metadata", "pretrain_gpt.py", MOCK + ["--load", "ck_badmeta"], "metadata.json is corrupt"),
    ("load-megatron-torch-format", "pretrain_gpt.py", MOCK + ["--load", "ck_megatron_torch", "--auto-detect-ckpt-format"],
     "mp_rank_00/model_optim_rng.pt: cannot read it"),
    ("convert-megatron-dist-format", C, CONVERT + ["--load-dir", "ck_megatron_dist", "--save-dir", "out"],
     "neither .metadata (torch_dist) nor mp_rank_*/model_optim_rng.pt (torch)"),
    ("load-other-model", "pretrain_gpt.py", MOCK + ["--load", "ck", "--hidden-size", "128"],
     "--hidden-size is 64 in the checkpoint and 128 in this run"),
    ("load-other-lr-schedule", "pretrain_gpt.py", MOCK + ["--load", "ck", "--lr", "2e-3"],
     "--lr is 0.001 in the checkpoint and 0.002 in this run"),
    ("load-both-schedules", "pretrain_gpt.py", MOCK + ["--load", "ck", "--override-opt_param-scheduler",
                                                       "--use-checkpoint-opt_param-scheduler"],
     "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive"),
    ("checkpoint-args-without-load", "pretrain_gpt.py", MOCK + ["--use-checkpoint-args"],
     "--use-checkpoint-args needs --load"),
    ("checkpoint-args-corrupt-metadata", "pretrain_gpt.py", ["--mock-data", "--train-iters", "1", "--use-checkpoint-args",
                                                             "--load", "ck_badmeta"], "metadata.json is corrupt"),
    # -- tools/generate.py ---------------------------------------------------------------------------
    ("generate-load-missing", G, ["--load", "nowhere", "--prompt", "1"], "--load nowhere"),
    ("generate-bad-tracker", G, ["--load", "ck_badtracker", "--prompt", "1"], "latest_checkpointed_iteration.txt"),
    ("generate-rank-file-missing", G, ["--load", "ck_norank", "--prompt", "1", "--tokenizer-type", "NullTokenizer"],
     "rank_00000.safetensors (FileNotFoundError"),
    ("generate-temperature-0", G, ["--load", "ck", "--prompt", "1", "--temperature", "0"], "--temperature"),
    ("generate-prompt-not-ids", G, ["--load", "ck", "--prompt", "hello", "--tokenizer-type", "NullTokenizer"],
     "'hello'"),
    ("generate-tokenizer-model-missing", G, ["--load", "ck", "--prompt", "1", "--tokenizer-type",
                                             "SentencePieceTokenizer", "--tokenizer-model", "nope.model"],
     "--tokenizer-model nope.model"),
    # -- tools/checkpoint/convert.py -------------------------------------------------------------------
    ("convert-into-nonempty-dir", C, CONVERT + ["--load-dir", "ck", "--save-dir", "busy"], "--save-dir busy"),
    ("convert-into-a-file", C, CONVERT + ["--load-dir", "ck", "--save-dir", "notes.txt"], "--save-dir notes.txt"),
    ("convert-corrupt-index", C, CONVERT + ["--load-dir", "ck_badindex", "--save-dir", "out"],
     "index.jsonl: cannot read the checkpoint index"),
    ("convert-tp-does-not-divide", C, CONVERT + ["--load-dir", "ck", "--save-dir", "out",
                                                 "--target-tensor-parallel-size", "3"], "--target-tensor-parallel-size 3"),
    ("convert-hf-bad-config", C, ["--model-type", "GPT", "--loader", "hf", "--saver", "megalite", "--load-dir", "hf_bad",
                                  "--save-dir", "out"], "hf_bad: config.json"),
    ("convert-tokenizer-type-unknown", C, CONVERT[:4] + ["--saver", "hf", "--load-dir", "ck", "--save-dir", "out",
                                                         "--tokenizer-type", "TikTokenizer"], "--tokenizer-type"),
    # -- tools/preprocess_data.py ------------------------------------------------------------------------
    ("preprocess-output-exists", P, ["--input", "corpus.jsonl", "--output-prefix", "data/good"] + NULL,
     "good_text_document.bin already exists"),
    ("preprocess-input-missing", P, ["--input", "nope.jsonl", "--output-prefix", "x"] + NULL, "--input nope.jsonl"),
    ("preprocess-vocab-file-garbage", P, ["--input", "corpus.jsonl", "--output-prefix", "x", "--tokenizer-type",
                                          "GPT2BPETokenizer", "--vocab-file", "vocab.json", "--merge-file", "merges.txt"],
     "--vocab-file vocab.json"),
    ("preprocess-id-beyond-vocab", P, ["--input", "corpus.jsonl", "--output-prefix", "x"] + NULL, "token id 5000"),
    ("preprocess-gz-truncated", P, ["--input", "trunc.jsonl.gz", "--output-prefix", "x"] + NULL,
     "--input trunc.jsonl.gz: cannot be read as gzip"),
    ("preprocess-gz-garbage", P, ["--input", "garbage.jsonl.gz", "--output-prefix", "x", "--workers", "2"] + NULL,
     "--input garbage.jsonl.gz: cannot be read as gzip"),
    ("preprocess-zst-garbage", P, ["--input", "garbage.jsonl.zst", "--output-prefix", "x"] + NULL,
     "--input garbage.jsonl.zst: cannot be read as zstd"),
    ("preprocess-parquet-garbage", P, ["--input", "garbage.parquet", "--output-prefix", "x"] + NULL,
     "--input garbage.parquet: cannot be read as parquet"),
    ("load-truncated-rank-file", "pretrain_gpt.py", MOCK + ["--load", "ck_truncrank"],
     "ck_truncrank/iter_0000001/rank_00000.safetensors"),
    ("generate-truncated-rank-file", G, ["--load", "ck_truncrank", "--prompt", "1", "--tokenizer-type",
                                         "NullTokenizer"], "ck_truncrank/iter_0000001/rank_00000.safetensors"),
    ("convert-truncated-rank-file", C, CONVERT + ["--load-dir", "ck_truncrank", "--save-dir", "out"],
     "ck_truncrank/iter_0000001/rank_00000.safetensors"),
    ("preprocess-workers-0", P, ["--input", "corpus.jsonl", "--output-prefix", "x", "--workers", "0"] + NULL,
     "--workers"),
    # -- tools/train_tokenizer.py, tools/plan.py -------------------------------------------------------------
    ("train-tokenizer-output-exists", T, ["--input", "corpus.jsonl", "--model-prefix", "tok"], "tok.model already exists"),
    ("train-tokenizer-bad-json", T, ["--input", "bad.jsonl", "--model-prefix", "newtok", "--vocab-size", "300"],
     "bad.jsonl line 2"),
    # -- context parallelism: sizes that do not divide, and what cannot follow a sequence split -----------
    ("cp-world-not-divisible", "pretrain_gpt.py", MOCK + ["--context-parallel-size", "2"],
     "x --context-parallel-size (2)"),
    ("cp-seq-not-divisible", "tools/plan.py", TINY + ["--seq-length", "20", "--context-parallel-size", "4",
                                                      "--world-size", "4"],
     "--context-parallel-size 4 needs --seq-length (20) divisible by 2 x CP = 8"),
    ("cp-sp-seq-not-divisible", "tools/plan.py", TINY + ["--seq-length", "20", "--context-parallel-size", "2",
                                                         "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                         "--world-size", "4"],
     "--context-parallel-size 2 needs --seq-length (20) divisible by 2 x CP x --tensor-model-parallel-size"),
    ("plan-etp-ep-not-dividing", "tools/plan.py", TINY + ["--num-experts", "4", "--disable-bias-linear",
                                                          "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                          "--expert-tensor-parallel-size", "1",
                                                          "--expert-model-parallel-size", "4", "--world-size", "2"],
     "--expert-tensor-parallel-size (1) x --expert-model-parallel-size (4) must divide TP x DP x CP"),
    ("plan-heads-not-divisible", "tools/plan.py", TINY + ["--tensor-model-parallel-size", "3", "--world-size", "3"],
     "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"),
]


def _check_refused(proc, culprit: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"status {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert culprit in lines[0], lines[0]


CONCURRENCY = min(3, (os.cpu_count() or 1) + 1)  # most cases end in argument checks: start-up-bound


@pytest.fixture(scope="module")
def refusals(world, request, tmp_path_factory):
    """{case id: (process, tree before, tree after)} for every selected case of the test below,
    CONCURRENCY at a time, each in its own copy of `world` (so a case that changed a file would
    still be the one caught, whatever runs beside it). Each case is a process of its own, forked
    from one that has imported torch already (fork_runner.py): start-up is paid once."""
    test = test_bad_input_is_refused_and_changes_nothing.__name__
    selected = {item.callspec.id for item in request.session.items
                if getattr(item, "originalname", None) == test and hasattr(item, "callspec")}

    cases = [c for c in CASES if c[0] in selected]
    if not cases:
        return {}
    runner = ForkRunner(min(CONCURRENCY, len(cases)), _env())

    def run(case):
        cid, tool, args, _ = case
        where = tmp_path_factory.mktemp(cid)
        root = str(where / "world")
        shutil.copytree(world, root)
        before = _tree(root)
        proc = runner.run(os.path.join(ROOT, tool), args, root, str(where / "log"))
        return cid, (proc, before, _tree(root))
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            return dict(pool.map(run, cases))
    finally:
        runner.close()


@pytest.mark.parametrize("case,culprit", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(refusals, case, culprit):
    proc, before, after = refusals[case]
    _check_refused(proc, culprit)
    assert after == before


def test_torchrun_reports_a_bad_flag_once(world):
    """Two ranks fail alike: one line (from rank 0), no traceback from either rank, and it is the
    first line of the run's output. Plain torchrun then adds its ChildFailedError report (status 1),
    whose root cause is that line; `python -m megalite.launch` adds no report and exits 2."""
    before = _tree(world)
    expected = "pretrain_gpt.py: error: --micro-batch-size must be an integer >= 1, got 0"
    with ThreadPoolExecutor(2) as pool:
        plain, launched = pool.map(lambda launcher: _run("pretrain_gpt.py", MOCK + ["--micro-batch-size", "0"],
                                                         world, nproc=2, launcher=launcher),
                                   ("torch.distributed.run", "megalite.launch"))
    for proc in plain, launched:
        out = proc.stdout + proc.stderr
        assert out.splitlines()[0] == expected, out[-3000:]
        assert [line for line in out.splitlines() if line.startswith("pretrain_gpt.py")] == [expected], out[-3000:]
        ours = [f'File "{os.path.join(ROOT, d)}' for d in ("megalite", "pretrain_gpt.py", "tools")]
        assert not any(frame in out for frame in ours), out[-3000:]
    assert plain.returncode == 1, plain.stderr[-3000:]  # torchrun's status for any failed worker
    root_cause = plain.stderr[plain.stderr.index("Root Cause"):]
    assert f"traceback : {expected}" in root_cause, plain.stderr[-3000:]
    assert launched.returncode == 2 and "Traceback" not in launched.stderr, launched.stderr[-3000:]
    assert _tree(world) == before


def test_a_busy_master_port_is_named(world):
    """Rank 0 hosts the env:// store on MASTER_PORT, the in-process launcher its own on
    --master-port: a port another process listens on is an error line naming it, not a
    DistNetworkError traceback."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**_env(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        proc = subprocess.run([PY, os.path.join(ROOT, "pretrain_gpt.py"), *MOCK], cwd=world, env=env,
                              capture_output=True, text=True, timeout=120)
        _check_refused(proc, f"MASTER_PORT {port} on 127.0.0.1 is in use")
        # the in-process restart launcher hosts its store there too (--master-port)
        proc = subprocess.run([PY, "-m", "megalite.inprocess", "--nproc-per-node", "2", "--master-port", str(port),
                               os.path.join(ROOT, "pretrain_gpt.py"), *MOCK, "--inprocess-restart"], cwd=world,
                              env=_env(), capture_output=True, text=True, timeout=120)
        _check_refused(proc, f"--master-port {port} on 127.0.0.1 is in use")


def test_launcher_keeps_torchrun_report_for_other_failures():
    """Only a refusal (status 2, or a worker stopped after one) is reported by its error line alone."""
    from types import SimpleNamespace as F

    from megalite.launch import refused
    assert refused({0: F(exitcode=2), 1: F(exitcode=-15)}) and refused({0: F(exitcode=2), 1: F(exitcode=2)})
    assert not refused({0: F(exitcode=1), 1: F(exitcode=-15)})
    assert not refused({0: F(exitcode=2), 1: F(exitcode=1)})
    assert not refused({0: F(exitcode=-9)})


def _load_tool(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3] + "_under_test", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_tool_takes_the_same_tokenizer_types(world, tmp_path):
    """One list: every name in TOKENIZER_TYPES parses in every tool, and an unknown one nowhere."""
    from megalite.arguments import parse_args
    from megalite.config.data import TOKENIZER_TYPES
    from megalite.data.tokenizers import TOKENIZERS
    from megalite.errors import UserError

    assert TOKENIZER_TYPES == tuple(TOKENIZERS)  # the flag's choices (config/) name the registry exactly
    assert "GPTSentencePieceTokenizer" in TOKENIZER_TYPES and "NullTokenizer" in TOKENIZER_TYPES
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n')
    parsers = {
        "pretrain_gpt.py": lambda t: parse_args(["--tokenizer-type", t]),
        P: lambda t: _load_tool(P).get_args(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                             str(tmp_path / "o"), "--tokenizer-type", t]),
        G: lambda t: _load_tool(G).get_args(["--load", "x", "--prompt", "1", "--tokenizer-type", t]),
        C: lambda t: _load_tool(C).get_args(CONVERT[:4] + ["--saver", "hf", "--load-dir", str(tmp_path),
                                                           "--save-dir", str(tmp_path / "new"), "--tokenizer-type", t]),
    }
    for tool, parse in parsers.items():
        for t in TOKENIZER_TYPES:
            assert vars(parse(t))["tokenizer.tokenizer_type"] == t, tool  # every tool: TokenizerConfig's flags
        with pytest.raises(UserError, match="--tokenizer-type"):
            parse("BertWordPieceLowerCase")


def test_gpt_sentencepiece_tokenizer_is_sentencepiece(world, tmp_path):
    """Megatron's GPTSentencePieceTokenizer: the same tokenizer, accepted by pretrain_gpt.py too."""
    from types import SimpleNamespace

    from megalite.arguments import parse_args, validate_args
    from megalite.data.tokenizers import SentencePieceTokenizer, build_tokenizer
    model = str(tmp_path / "sp.model")
    assert _load_tool(T).main(["--input", os.path.join(ROOT, "data", "corpus.jsonl"), "--model-prefix",
                               str(tmp_path / "sp"), "--vocab-size", "400", "--input-sentence-size", "500",
                               "--num-threads", "1"]) == 0
    a = build_tokenizer(SimpleNamespace(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model))
    b = build_tokenizer(SimpleNamespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model))
    assert isinstance(a, SentencePieceTokenizer)
    assert a.tokenize("Once upon a time") == b.tokenize("Once upon a time") and a.eod == b.eod == 2
    args = validate_args(parse_args(["--data-path", os.path.join(world, "data", "good_text_document"),
                                     "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
                                    + TINY), 1)
    assert args.tokenizer.tokenizer_type == "GPTSentencePieceTokenizer"


def test_tracker_name_is_defined_once():
    """The latest-pointer's name is assigned in checkpoint/paths.py only (torch-free, so that
    checking --load needs no torch); every other module imports it."""
    import ast
    import glob

    from megalite.checkpoint import paths as checkpoint_paths
    assert checkpoint_paths.TRACKER == "latest_checkpointed_iteration.txt"
    where = [path for path in glob.glob(os.path.join(ROOT, "megalite", "**", "*.py"), recursive=True)
             for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Constant) and node.value.value == checkpoint_paths.TRACKER]
    assert [os.path.relpath(p, ROOT) for p in where] == [os.path.join("megalite", "checkpoint", "paths.py")]


def test_a_bug_keeps_its_traceback(capsys):
    """Only UserError becomes one line: anything else is a bug and must show where it happened."""
    from megalite.errors import UserError, cli

    @cli("prog")
    def main(argv=None):
        if argv == ["user"]:
            raise UserError("--flag must be >= 1\nsecond line")
        raise KeyError("internal")

    assert main(["user"]) == 2
    assert capsys.readouterr().err == "prog: error: --flag must be >= 1 second line\n"
    with pytest.raises(KeyError):
        main(["bug"])
