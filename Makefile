# DDPJob developer entry points. `make demo` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PY     := $(VENV)/bin/python
DDPJOB := $(VENV)/bin/ddpjob
# Machine-level caches, so a fresh clone on the same machine neither re-downloads torch nor rebuilds Kubernetes.
export DDPJOB_CACHE ?= $(HOME)/.cache/ddpjob
export UV_CACHE_DIR ?= $(HOME)/.cache/uv
export UV_LINK_MODE ?= hardlink
STAMP  := $(VENV)/.installed
# The trainer image's torch and MLflow client (hack/versions.env, the one home of those pins), which
# are also pyproject's floors: a second venv runs the trainer tiers on them, so what users run is what we test.
FLOOR_VENV ?= .venv-floor
FLOOR_PY   := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_PINS := $(shell . hack/versions.env && echo "torch==$$TORCH_VERSION torchvision==$$TORCHVISION_VERSION mlflow==$$MLFLOW_VERSION")
PYTEST_ARGS ?=

.PHONY: help install install-floor demo test test-floor test-unit test-trainer test-cluster test-e2e test-realpods cluster-up \
        cluster-down build-cluster images manifests bench lint clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(VENV)/bin/python -m pip install -q --disable-pip-version-check 'uv>=0.4'
	$(VENV)/bin/uv pip install --python $(PY) -e '.[test,trainer]'
	@touch $@

install: $(STAMP) ## create .venv with the project and its test deps (idempotent)

$(FLOOR_STAMP): pyproject.toml hack/versions.env $(STAMP)
	@test -x $(FLOOR_PY) || python3 -m venv $(FLOOR_VENV)
	$(VENV)/bin/uv pip install --python $(FLOOR_PY) -e '.[test,trainer]' $(FLOOR_PINS)
	@touch $@

install-floor: $(FLOOR_STAMP) ## create .venv-floor: the project on the trainer image's torch (pyproject's floor)

demo: install ## train examples/digits.yaml on 2 simulated nodes with a progress bar
	$(DDPJOB) run examples/digits.yaml --local

test: install install-floor cluster-up images ## every tier (cluster tiers beside the CPU tiers, hack/test.sh), the trainer's again on the image's torch; CI runs exactly this
	PY=$(PY) PYTEST_ARGS="$(PYTEST_ARGS)" hack/test.sh

# What depends on torch's version: local multi-process runs (convergence, a killed rank, the
# seed-style custom script, signals), checkpoint save/resume (bit-exact at world size 2), compile,
# the CUDA-only group, failure records, and the trainer's pure pieces (checkpoint format, storage,
# torchapi, tracking). MLflow's floor client: the launcher's run resolution as unit tests (a fake
# client on MLflow's entities) and its real child process against a refusing server (no tracking
# server to start); with a real server the floor pins run in the real-pod tier (the trainer image:
# node 0's launcher creates the run, node 1's finds it, the trainer resumes it). Left to the main
# venv: the launcher's pre-flight, gpu_check's plumbing, the GPU-path env checks and the Trainer
# class's shape, which ask nothing version-specific of torch.
FLOOR_TESTS := $(addprefix tests/trainer/,test_local_runs.py test_checkpoint_resume.py test_trainer_exactness.py \
               test_compile.py test_device_only_group.py test_failure_messages.py test_launcher_signals.py) \
               $(wildcard tests/unit/test_trainer_*.py) \
               tests/trainer/test_mlflow.py::test_a_launcher_without_a_run_fails_the_attempt_only_when_mlflow_is_required
test-floor: install-floor ## the trainer tiers on the trainer image's torch (hack/versions.env)
	$(FLOOR_PY) -m pytest -ra $(PYTEST_ARGS) $(FLOOR_TESTS)

test-unit: install ## pure functions only
	$(PY) -m pytest -ra $(PYTEST_ARGS) tests/unit

test-trainer: install ## real torchrun processes on CPU
	$(PY) -m pytest -ra $(PYTEST_ARGS) tests/trainer

test-cluster: install cluster-up ## the operator against the local control plane
	$(PY) -m pytest -ra $(PYTEST_ARGS) tests/cluster

test-e2e: install cluster-up ## Helm + Prometheus end to end
	$(PY) -m pytest -ra $(PYTEST_ARGS) tests/e2e

test-realpods: install cluster-up images ## DDPJobs that really train in pods on the real nodes
	$(PY) -m pytest -ra $(PYTEST_ARGS) tests/realpods

lint: install ## ruff and mypy ([tool.ruff], [tool.mypy] in pyproject.toml); CI runs it before make test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

images: install cluster-up ## build localhost/ddpjob/{operator,trainer}:dev with buildah; import into the real nodes
	hack/images.sh all

build-cluster: ## build (or reuse cached) the control plane, kwok, helm, kubelet, CoreDNS
	hack/build.sh all

cluster-up: build-cluster ## control plane + kwok GPU nodes + 2 real nodes (DDPJOB_REAL_NODES=0: none)
	hack/cluster-up.sh

cluster-down: ## stop the local control plane and remove its state
	hack/cluster-down.sh

manifests: install ## regenerate manifests/ from the Helm chart (a test fails when they drift)
	hack/build.sh helm
	hack/gen-manifests.sh

.PHONY: docs
docs: install ## regenerate the chart README (values.yaml's comments) and docs/crd-reference.md (a test fails when stale)
	$(PY) hack/gen-docs.py

# The trainer's benches first: the checkpoint arms wait on fsync, and a running control plane's etcd
# (an fsync per write) makes those times swing by 4x. They need no cluster.
bench: install ## benchmarks (ratios, JSON under bench/results/)
	$(PY) bench/trainer_overhead.py
	$(PY) bench/metrics_overhead.py
	$(PY) bench/mlflow_overhead.py
	$(PY) bench/checkpoint.py
	$(MAKE) cluster-up
	$(PY) bench/operator_scale.py
	$(PY) bench/fairness.py
	$(PY) bench/recovery.py

# Needs NVIDIA GPUs, no cluster (docs/development.md); exits 2 where torch sees none. On the image's
# torch: make gpu-check PY=.venv-floor/bin/python. GPU_CHECK_ARGS=--cpu: the same plumbing on gloo.
.PHONY: gpu-check
gpu-check: install ## GPU acceptance run: NCCL, bf16, channels_last, compile, async checkpoint + resume; one table
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean: cluster-down ## remove the venv and local caches of this clone
	rm -rf $(VENV) .cache .pytest_cache
