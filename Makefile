# `make demo` and `make test` set everything up on a fresh machine: a virtual environment with the
# pinned CPU build of torch, the project and its test tools, and the SmolLM2 test checkpoint.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swarmnode-installed
export HF_HUB_OFFLINE := 1

.PHONY: demo test lint bench bench-planner bench-load bench-disaggregation soak model install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU wheel of torch (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# headless Chromium for the dashboard test (Debian's package; needs root, skipped when present or not root)
	command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) || \
		echo "could not install chromium: the dashboard test needs it (run make install as root)"
	# nft for the NAT router of the namespace tests (Debian's nftables; needs root, skipped when present or not root)
	command -v nft >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables) || \
		echo "could not install nftables: the NAT test needs nft (run make install as root)"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) scripts/prepare_model.py

demo: model
	$(PY) scripts/demo.py

test: model
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist loadscope

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: model
	$(PY) scripts/bench_generate.py

bench-planner: $(STAMP)
	$(PY) scripts/bench_planner.py

# 16 concurrent clients on a 3-node swarm, with and without room for every session's cache
bench-load: model
	$(PY) scripts/bench_load.py

# 4 one-core nodes colocated vs split into prefill and decode nodes, steady decode streams under long prompts
bench-disaggregation: model
	$(PY) scripts/bench_disaggregation.py

# nodes join, are SIGKILLed and restart while clients generate (SOAK_ARGS=--short for the CI form)
soak: model
	$(PY) scripts/soak_churn.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
