import inspect
import os
import re
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


# -- processes: the `launches` marker -----------------------------------------------------------
# A test that starts Python processes (pretrain_gpt.py on pool ranks or under torchrun, spawned
# gloo ranks, a tool as a subprocess, also through a fixture) carries the `launches` marker, so
# that `make test-fast` (-m "not launches and not slow") is the in-process unit tests alone. The
# marker is added here for tests that use a launching fixture or call a launching helper in their
# own body; any other test that starts a process fails at once with a message asking for the
# marker, so a new test cannot forget it and slip into the fast set.
LAUNCHING_FIXTURES = {"corpus"}  # and every fixture whose own code launches (found below)
LAUNCHING_CALLS = re.compile(r"\b(run_pretrain|spawn|start_torchrun|subprocess\.\w+|Popen)\(|sys\.executable")


def _launches(fn, depth: int = 3) -> bool:
    """fn's code calls a launching helper, itself or through functions of its own module."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if LAUNCHING_CALLS.search(source):
        return True
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if depth == 0 or module is None:
        return False
    for name in set(re.findall(r"\b(\w+)\(", source)):
        callee = getattr(module, name, None)
        if (inspect.isfunction(callee) and callee is not fn and callee.__module__ == module.__name__
                and _launches(callee, depth - 1)):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    _mark_launches(items)
    _heaviest_files_first(items)


def _mark_launches(items):
    for item in items:
        if item.get_closest_marker("launches"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        names = info.names_closure if info is not None else ()
        fixture_fns = [d.func for n in names for d in info.name2fixturedefs.get(n, ())] if info is not None else []
        if (set(names) & LAUNCHING_FIXTURES or _launches(getattr(item, "function", None))
                or any(_launches(f) for f in fixture_fns if getattr(f, "__module__", "").startswith("test_"))):
            item.add_marker(pytest.mark.launches)


# -- order: the heaviest test files first ----------------------------------------------------------
# `make test` hands whole files to two xdist workers (--dist loadfile) in collection order
# (--no-loadscope-reorder: xdist's own order, most tests first, put the one-test torchrun files
# last, where one of them kept a worker busy while the other had nothing left). Longest first
# (LPT scheduling) leaves the many cheap files for the end, so both workers finish together.
# A file's weight: for files whose few tests are long runs, its seconds (test_compile,
# test_megatron_examples and test_restart: CPU seconds measured alone on 2 cores; the gpt-oss,
# MTP and Megatron-LM script files: as their commits report them; the others estimated from their
# runs); otherwise an estimate from its tests (a launching test ~3 s, another ~0.05 s). A name
# listed here for a file that is not there is ignored.
FILE_SECONDS = {"test_compile.py": 150, "test_layouts_gpt_oss.py": 125, "test_megatron_examples.py": 50,
                "test_megatron_moe_examples.py": 15, "test_spikes.py": 30, "test_megatron_mixtral_example.py": 50,
                "test_qwen3_examples.py": 50, "test_mtp.py": 50, "test_restart.py": 22, "test_lifecycle.py": 30,
                "test_straggler.py": 25, "test_timeout.py": 25, "test_mla.py": 95, "test_layouts_deepseek_v3.py": 70,
                "test_hf_deepseek.py": 45, "test_upcycling.py": 40, "test_zero_bubble.py": 20,
                "test_layouts_muon.py": 25, "test_qk_clip.py": 45, "test_optimizer_precision.py": 25,
                "test_megatron_hf.py": 25, "test_megatron_checkpoints.py": 60,
                "test_cp_comm_types.py": 35, "test_bad_input.py": 35, "test_memory_wall.py": 20,
                "test_layouts_attention_2026.py": 310, "test_hf_qwen3_next.py": 20, "test_plan_attention_2026.py": 40,
                # Megatron-LM's configurations: 212 validations, then 3 shrunk trainings of 4 ranks
                # (measured ~175 s with another job running; ~100 s alone estimated)
                "test_megatron_configs.py": 100, "test_megatron_config_flags.py": 20,
                # FP8 (emulated): 8 layouts + 2 resumes + the TP layer checks, 4 references
                # (~8 min under a load average of 12; ~2 min alone estimated); test_fp8's four runs
                "test_layouts_fp8.py": 120, "test_fp8.py": 20,
                # resilience (issue 42): estimated from their wall time on the shared machine
                "test_rerun.py": 45, "test_non_persistent.py": 40, "test_weight_hash.py": 20,
                "test_inprocess_restart.py": 35}


def _heaviest_files_first(items):
    weight = {}
    for item in items:
        name = item.path.name
        weight[name] = weight.get(name, 0.0) + (3.0 if item.get_closest_marker("launches") else 0.05)
    weight.update((name, seconds) for name, seconds in FILE_SECONDS.items() if name in weight)
    first = {}  # each file's first position: files keep their own test order
    for i, item in enumerate(items):
        first.setdefault(item.path.name, i)
    items.sort(key=lambda item: (-weight[item.path.name], first[item.path.name]))


def _is_python_launch(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    text = " ".join(map(str, argv))
    return "python" in os.path.basename(str(argv[0])) or ".py" in text or "torch.distributed.run" in text


@pytest.fixture(autouse=True)
def _launches_are_marked(request, monkeypatch):
    """Outside `launches` tests, starting a Python process is an error that names the marker."""
    if request.node.get_closest_marker("launches"):
        yield
        return
    import multiprocessing.process
    why = (f"{request.node.nodeid} starts a Python process: mark it @pytest.mark.launches "
           f"(make test-fast leaves such tests out)")
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *a, **kw):
        if _is_python_launch(args):
            raise AssertionError(why)
        return popen_init(self, args, *a, **kw)

    def guarded_start(self):
        raise AssertionError(why)
    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
    yield


def pytest_sessionfinish(session, exitstatus):
    if "launch_pool" in sys.modules:
        sys.modules["launch_pool"].shutdown()


@pytest.fixture(scope="session")
def tiny_flags():
    """tiny.tiny: the tiny GPT's flags, with keyword overrides (see tests/tiny.py)."""
    from tiny import tiny
    return tiny
