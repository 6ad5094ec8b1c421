# Set-up is two commands on a fresh Debian machine: `make demo` and `make test`.
# Debian's own interpreter when there is one, as a node runs devinject: it is built with PGO and LTO, and
# the hook's Python work runs ~20% faster in it than in an unoptimized build (bench/bench_hook.py).
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
VENV := .venv
BIN := $(VENV)/bin
DEMO_HOST := tests/fixtures/hosts/hgx-h100
SYSTEM_PACKAGES := python3-venv runc podman crun busybox-static gcc libc6-dev graphviz containerd systemd systemd-journal-remote mmdebstrap prometheus
# The agent's image (`make image`): an OCI archive that `ctr -n k8s.io images import` and `podman load` read.
IMAGE := build/devinject-image.tar
IMAGE_INPUTS := pyproject.toml README.md tools/mkimage.py $(wildcard deploy/image/*) \
	$(shell find src/devinject -name __pycache__ -prune -o -type f -print)

.PHONY: demo test check lint unit live bench golden fixtures system-deps venv clean mutation proto image cluster-test

# Two stages: what devinject runs (`make demo` needs no more), then the tools the tests and lint use. Every
# package is pinned in constraints.txt, so a clean clone installs today's versions next month too.
PIP_INSTALL := $(BIN)/pip install -q -c constraints.txt

$(BIN)/devinject: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.dev: $(BIN)/devinject
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

venv: $(VENV)/.dev

# Debian packages the live tests drive (real runc, podman, crun), build fixture libraries with, and check
# the systemd units with (systemd-analyze), write kernel lines into a journal (systemd-journal-remote), build the agent's image with (mmdebstrap), and scrape the agent with
# (prometheus: test_prometheus_live runs an instance of its own on a free port, never the package's service).
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

DEMO_OUT := build/demo

demo: $(BIN)/devinject
	@echo "== devinject list --root $(DEMO_HOST)"
	@$(BIN)/devinject list --root $(DEMO_HOST)
	@mkdir -p $(DEMO_OUT)
	@$(BIN)/devinject generate --root $(DEMO_HOST) --kind nvidia.com/gpu --output $(DEMO_OUT)/nvidia.com-gpu.yaml \
		--hook-path $(abspath $(BIN))/devinject
	@echo
	@echo "== devinject generate --root $(DEMO_HOST) --kind nvidia.com/gpu   (its first lines; all of it in $(DEMO_OUT)/nvidia.com-gpu.yaml)"
	@head -n 30 $(DEMO_OUT)/nvidia.com-gpu.yaml
	@echo "   ... $$(wc -l < $(DEMO_OUT)/nvidia.com-gpu.yaml) lines"

lint: venv
	$(BIN)/ruff check src tests bench tools
	$(BIN)/mypy

# --durations: the slowest tests in CI's log, to keep the whole run under its hour
test: system-deps venv lint
	$(BIN)/pytest -q --durations=25

unit: venv
	$(BIN)/pytest -q -m 'not live'

live: system-deps venv
	$(BIN)/pytest -q -m live

# The DaemonSet on a real one-node cluster (../shared/kube/cluster-up.sh, or DEVINJECT_KUBE), on containerd 1.7
# with CDI and on Debian's 1.6, as root: tests/e2e/test_cluster_live.py (`make test` runs it too); the cluster
# is down again afterwards. Prints the figures it measured.
cluster-test: system-deps venv
	$(BIN)/pytest -q tests/e2e/test_cluster_live.py
	@cat build/cluster-figures.json

# The agent's image with no registry: Debian's packages (mmdebstrap, the tree cached in build/image), the
# wheels of deploy/image/requirements.txt and devinject from this tree; image localhost/devinject:<version>.
image: $(IMAGE)

$(IMAGE): $(IMAGE_INPUTS) | system-deps venv
	$(BIN)/python tools/mkimage.py --output $@

# Mutation testing of the core modules ([tool.mutmut] in pyproject.toml), in a staging copy without the
# fixture trees; prints the score. Not part of `make test` (it takes minutes).
MUTATION_DIR := build/mutation
mutation: venv
	$(BIN)/pip install -q 'mutmut>=3.8'
	rm -rf $(MUTATION_DIR) && mkdir -p $(MUTATION_DIR)
	tar -c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./mutants \
		--exclude=./tests/fixtures/hosts --exclude=./tests/fixtures/proc . | tar -x -C $(MUTATION_DIR)
	cd $(MUTATION_DIR) && DEVINJECT_FIXTURES=$(abspath tests/fixtures) $(abspath $(BIN))/mutmut run --max-children 2 \
		> mutmut.log 2>&1 || (tail -20 mutmut.log; exit 1)
	cd $(MUTATION_DIR) && $(abspath $(BIN))/python $(abspath bench/mutation_score.py)

bench: venv
	$(BIN)/python bench/bench_generate.py
	$(BIN)/python bench/bench_hook.py
	$(BIN)/python bench/bench_cdi_hooks.py
	$(BIN)/python bench/bench_hook_imports.py
	$(BIN)/python bench/bench_specs.py
	$(BIN)/python bench/bench_watch.py
	$(BIN)/python bench/bench_health_latency.py
	$(BIN)/python bench/bench_topology.py
	$(BIN)/python bench/bench_dra.py
	$(BIN)/python bench/bench_sharing.py

# Rebuild the fixture hosts (needs gcc and ldconfig) and then their golden specs; HOSTS="a b" for only those
# (hosts added as plain data have no builder and are never touched).
fixtures: venv
	$(BIN)/python tests/fixtures/build_hosts.py $(HOSTS)
	$(BIN)/pytest -q tests/integration/test_golden.py --update-golden $(if $(HOSTS),-k "$(shell echo $(HOSTS) | sed 's/ / or /g')")

# The kubelet device plugin and DRA APIs: Python modules generated from the .proto files (committed; tests check
# they match).
proto: venv
	$(BIN)/python -m grpc_tools.protoc -Isrc --python_out=src --pyi_out=src --grpc_python_out=src \
		src/devinject/deviceplugin/api/v1beta1.proto $(wildcard src/devinject/dra/api/*.proto)

golden: venv
	$(BIN)/pytest -q tests/integration/test_golden.py --update-golden

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build mutants
