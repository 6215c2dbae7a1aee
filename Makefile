# gpucloud — `make up` runs a local cloud, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Debian packages: what the cloud needs to run pods, and what the tests need on top.
RUN_PACKAGES := runc busybox-static iproute2 iptables fuse3
TEST_PACKAGES := $(RUN_PACKAGES) postgresql docker-registry umoci skopeo libfuse3-dev criu \
	stargz-snapshotter containerd \
	openssh-client openssh-server openssh-sftp-server gcc libc6-dev \
	chromium chromium-driver faketime

# Two test processes, each whole test file on one of them (its module fixtures, a cluster
# or a replica set, start once); most of the suite waits on runc, agents and databases.
# Files go out in collection order, longest first (tests/conftest.py LONGEST_FIRST), not
# xdist's default of most tests first, which left the long single-test files for the end.
PYTEST_PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: up test lint typecheck unit bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

up: $(BIN)/.installed
	scripts/ensure-packages.sh $(RUN_PACKAGES)
	@ln -sfn "$(CURDIR)/$(BIN)/gpucloud" /usr/local/bin/gpucloud 2>/dev/null \
		&& echo "the gpucloud command: /usr/local/bin/gpucloud -> $(CURDIR)/$(BIN)/gpucloud" \
		|| echo "to use the gpucloud command, add $(CURDIR)/$(BIN) to your PATH"
	$(BIN)/gpucloud up

test: $(BIN)/.installed
	scripts/ensure-packages.sh $(TEST_PACKAGES)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/pytest $(PYTEST_PARALLEL)

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests bench

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(BIN)/pytest tests/unit

bench: $(BIN)/.installed
	scripts/ensure-packages.sh $(TEST_PACKAGES)
	$(BIN)/python bench/api.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
