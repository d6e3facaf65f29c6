# hami-py: the two commands a new user needs are `make up` and `make test`.
# Everything else here is a step of those two, or a developer convenience.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

UV_VERSION := 0.13.9
TOOLS_DIR := .hamipy/tools
UV := $(or $(shell command -v uv 2>/dev/null),$(TOOLS_DIR)/bin/uv)
RUN := $(UV) run --frozen --no-sync

# Typed packages checked with mypy --strict (services join as their issues land).
TYPED_PACKAGES := hamipy.protocol hamipy.kube hamipy.devcluster hamipy.serving hamipy.telemetry hamipy.kubelet_api hamipy.manifests hamipy.webhook hamipy.extender hamipy.device_plugin hamipy.monitor
PYTEST_ARGS ?=

.PHONY: help sync lint typecheck native proto kube-binaries images test unit mutate bench gpu-test gpu-wheels up down gpus trace clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(TOOLS_DIR)/bin/uv:
	@echo "uv not found: installing uv $(UV_VERSION) into $(TOOLS_DIR)"
	python3 -m venv $(TOOLS_DIR)
	$(TOOLS_DIR)/bin/pip install --quiet uv==$(UV_VERSION)

.venv/.synced: $(UV) uv.lock pyproject.toml $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)
	# Bytecode compiled once here: where PYTHONDONTWRITEBYTECODE is set, every process the tests
	# and `make up` start (extenders, device plugins, CLIs) otherwise compiles its imports again
	# (an extender's imports: 4.3 s of CPU here, 1.5 s compiled; the images compile theirs too).
	$(UV) sync --frozen --all-packages --compile-bytecode
	@touch $@

sync: .venv/.synced ## install the workspace (all libs and services) from uv.lock

lint: sync ## ruff lint and format check, and the layer contracts (import-linter)
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) lint-imports --no-cache

typecheck: sync ## mypy --strict over the libs, the services and the tests
	$(RUN) mypy $(addprefix -p ,$(TYPED_PACKAGES))
	$(RUN) python tests/typecheck.py

native: ## build native/ (libvgpu.so, the fake driver, C test programs)
	@if [ -f native/Makefile ]; then $(MAKE) -C native; fi

proto: sync ## regenerate the kubelet device plugin API stubs from libs/kubelet-api/proto
	PATH="$(CURDIR)/.venv/bin:$$PATH" $(RUN) python libs/kubelet-api/generate.py

kube-binaries: sync native ## build (first run only) and cache the Kubernetes binaries, containerd and the images
	$(RUN) hamipy-devcluster binaries

images: sync ## build (when stale; as root) the four service images and kube-scheduler's, as archives for ctr
	$(RUN) python -m hamipy.devcluster.service_images

test: lint typecheck native kube-binaries ## everything CI runs: lint, types, native build, the whole suite
	$(RUN) pytest $(PYTEST_ARGS)

unit: sync ## the fast unit tests only
	$(RUN) pytest tests/unit $(PYTEST_ARGS)

mutate: sync ## mutation score of the decision code, not part of test (MODULES=a,b: some only)
	$(RUN) python tests/mutation/mutate.py $(if $(MODULES),--modules "$(MODULES)")

bench: sync native ## run the benchmarks; figures go to tests/bench/results/
	@for b in tests/bench/bench_*.py; do echo ">> $$b"; $(RUN) python $$b; done

gpu-test: ## isolation on a real GPU (tests/gpu/run.sh: the machine's python3, no sync needed)
	tests/gpu/run.sh

GPU_WHEELS := .hamipy/gpu-wheels
gpu-wheels: ## the device plugin's and monitor's wheels for an offline GPU machine (python3.12, x86_64)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(UV) export --frozen --no-hashes --no-dev --no-emit-workspace --package hamipy-device-plugin \
		--package hamipy-monitor -q -o $(GPU_WHEELS)/requirements.txt
	$(UV) tool run --from pip==25.3 pip download -q --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -r $(GPU_WHEELS)/requirements.txt -d $(GPU_WHEELS)
	@du -sh $(GPU_WHEELS)

up: sync native kube-binaries ## run the whole system locally (stays up until `make down`; MODE=chart: from the chart)
	$(RUN) hamipy-devcluster up $(if $(filter chart,$(MODE)),--chart)

gpus: ## every GPU of `make up`'s cluster: memory, cores, slots and the pods on it
	$(RUN) hamipy-devcluster gpus

trace: ## one pod's trace from admission to Allocate: make trace POD=namespace/name
	@if [ -z "$(POD)" ]; then echo "usage: make trace POD=namespace/name" >&2; exit 2; fi
	$(RUN) hamipy-devcluster trace "$(POD)"

down: ## stop what `make up` started
	@if [ -x .venv/bin/hamipy-devcluster ]; then $(RUN) hamipy-devcluster down; else echo "nothing to stop"; fi

clean: down ## remove build outputs and local state (not the cached Kubernetes binaries)
	rm -rf native/build .hamipy .venv .mypy_cache .ruff_cache .pytest_cache tests/bench/results
