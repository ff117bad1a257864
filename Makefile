# make demo   set up a virtual environment and pretrain a small GPT on the bundled corpus: the
#             data in data/build/, the run's log in runs/demo/; `make demo OUTPUT_DIR=/tmp/demo`
#             writes both under /tmp/demo instead (data in /tmp/demo/data/, the log in /tmp/demo/)
# make test   set up a virtual environment and run the whole test suite
# make gpu-check   on a CUDA machine: GPU tests, throughput, one-GPU runs -> benchmarks/RESULTS_gpu.md
# make test-fast   the in-process unit tests only (no pretrain runs, torchrun, spawned ranks or tool
#             subprocesses: pytest -m "not launches and not slow"), for the everyday loop
#
# Torch is installed first, pinned by TORCH_SPEC (override for your platform, e.g.
#   make test TORCH_SPEC='torch==2.5.1'   or   TORCH_SPEC='torch --index-url ...'),
# so that the package's own "torch>=2.5" never pulls a different build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megalite-installed
# where `make data` and `make demo` write (empty: into the checkout, data/build/ and runs/demo/),
# as the example scripts' OUTPUT_DIR
OUTPUT_DIR ?=
DATA_BUILD_DIR := $(if $(OUTPUT_DIR),$(OUTPUT_DIR)/data,data/build)
DEMO_DIR := $(if $(OUTPUT_DIR),$(OUTPUT_DIR),runs/demo)

.PHONY: setup demo test test-fast gpu-check data clean

# Bytecode: written by the first process that imports a module (PYTHONDONTWRITEBYTECODE, set on
# these machines, is not passed on to this Makefile's commands), so what the tests and the demo
# import is compiled once and the rest of the venv never: a training process imports ~2,400 of the
# venv's 12,700 modules (10 s of CPU to compile them), where compiling the whole venv took 60 s of
# CPU (34 s on 2 cores) and pip's own compilation, one file at a time, 55 s more of the install.
# Without bytecode a process that imports torch takes seconds longer to start, each time.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH_SPEC)
	$(PY) -m pip install -q --no-compile -e ".[test,hf]"
	touch $(STAMP)

setup: $(STAMP)

data: $(STAMP)
	DATA_BUILD_DIR='$(DATA_BUILD_DIR)' PYTHON=$(PY) bash data/prepare.sh

demo: data
	OMP_NUM_THREADS=2 $(PY) pretrain_gpt.py \
	    --data-path '$(DATA_BUILD_DIR)/corpus_text_document' --split 98,2,0 \
	    --tokenizer-type SentencePieceTokenizer --tokenizer-model '$(DATA_BUILD_DIR)/tokenizer.model' \
	    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
	    --micro-batch-size 16 --global-batch-size 32 --train-iters 200 \
	    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
	    --hidden-dropout 0 --attention-dropout 0 \
	    --log-interval 10 --eval-interval 100 --eval-iters 5 --log-jsonl '$(DEMO_DIR)/metrics.jsonl'

# the repository's own modules byte-compiled first (1 s of every test process's start-up otherwise).
# Two pytest workers (pytest-xdist), each test file on one of them (module fixtures are built once):
# the suite keeps both cores busy where one worker waited on a process's start-up or a single
# rank (840 s -> 670 s on 2 cores); TEST_WORKERS=0 runs it in one process. Files go to the workers
# heaviest first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order), so the
# cheap ones fill the end and both workers finish together
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m compileall -q -j 0 megalite tools tests benchmarks pretrain_gpt.py > /dev/null
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 tests

test-fast: $(STAMP)
	$(PY) -m compileall -q -j 0 megalite tools tests benchmarks pretrain_gpt.py > /dev/null
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests -m "not launches and not slow"

# on a machine with CUDA and a plain checkout (its own python, no venv): GPU tests, throughput
# beside transformers, one-GPU TP=1 and ZeRO-3 runs -> benchmarks/RESULTS_gpu.md; skips without CUDA
gpu-check:
	PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),$(PYTHON)) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) data/build runs
