# `make run` and `make test` set up .venv on first use (CPU torch pinned in constraints.txt).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run run-s3 test test-under-load bench harness lint dist clean simulate

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	@# fuse3 (libfuse3 + fusermount3) for the power-loss tests; they skip where it is missing.
	command -v fusermount3 >/dev/null || { [ "$$(id -u)" = 0 ] && { apt-get install -y -q fuse3 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fuse3 >/dev/null 2>&1; }; }; } || true
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,s3,app,bench,sim]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PY) -m apps.grpo.main --config configs/grpo.yaml

# The same run with checkpoints in a local S3 server (SeaweedFS; data and log in runs/seaweed).
run-s3: setup
	$(PY) -m apps.seaweed run --dir runs/seaweed -- $(PY) -m apps.grpo.main --config configs/grpo.yaml checkpoint.folder=s3://forge-ckpt/grpo

test: setup
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

# The suite RUNS times in a row while BURN processes burn the CPU (issue 22: no test may
# depend on timing); outcomes in runs/under_load.json.
RUNS ?= 3
BURN ?= 2
test-under-load: setup
	$(PY) scripts/under_load.py --runs $(RUNS) --burn $(BURN) -- $(PYTEST_ARGS)

# More seeded schedules of the protocol simulation than `make test` runs (docs/protocol.md).
SEEDS ?= 20000
simulate: setup
	$(PY) -m forge_ckpt.sim --seeds $(SEEDS)

bench: setup
	$(PY) -m benchmarks.run --merge-gpu docs/benchmarks_gpu.json
	$(PY) -m benchmarks.integrity
	$(PY) -m benchmarks.tiers
	$(PY) -m benchmarks.stall
	$(PY) -m benchmarks.grpo.overhead
	$(PY) -m benchmarks.grpo.save
	$(PY) -m benchmarks.async_rl

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

# sdist + wheel into dist/, then twine check and scripts/check_dist.py (what the archives hold;
# install the wheel into a fresh venv and run it from outside the checkout).
dist: setup
	rm -rf dist build
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*
	$(PY) scripts/check_dist.py dist --constraints constraints.txt

clean:
	rm -rf $(VENV) runs .pytest_cache dist build
