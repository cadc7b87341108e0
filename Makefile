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
        cluster-down build-cluster images manifests spec bench lint clean release test-oldest cluster-up-oldest cluster-down-oldest

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

# hack/test.sh does the rest of the set-up (the floor venv, both control planes, the images), side by side.
test: install ## every tier (cluster, CPU and oldest-Kubernetes sessions side by side, hack/test.sh), the trainer's again on the image's torch; CI runs exactly this
	PY=$(PY) PYTEST_ARGS="$(PYTEST_ARGS)" hack/test.sh

# What depends on torch's version: local multi-process runs (convergence, a killed rank, the
# seed-style custom script, signals), checkpoint save/resume (bit-exact at world size 2),
# the CUDA-only group, failure records, and the trainer's pure pieces (checkpoint format, storage,
# torchapi, tracking, torchft's wrapper). torchft's per-step mode (it needs torch >= 2.7) on this
# torch is the real-pod tier's (tests/realpods/test_per_step.py). MLflow's floor client:
# the launcher's run resolution as unit tests (a fake client on MLflow's entities) and its real
# child process against a refusing server (no tracking server to start); with a real server the
# floor pins run in the real-pod tier (the trainer image: node 0's launcher creates the run, node
# 1's finds it, the trainer resumes it). Left to the main venv: the launcher's pre-flight,
# gpu_check's plumbing, the GPU-path env checks and the Trainer class's shape, which ask nothing
# version-specific of torch.
FLOOR_TESTS := $(addprefix tests/trainer/,test_local_runs.py test_checkpoint_resume.py test_trainer_exactness.py \
               test_device_only_group.py test_failure_messages.py test_launcher_signals.py) \
               $(wildcard tests/unit/test_trainer_*.py) \
               tests/trainer/test_mlflow.py::test_a_launcher_without_a_run_fails_the_attempt_only_when_mlflow_is_required
# Not again here: the real-pod tier runs the same paths in the trainer image, on this same torch
# (tests/realpods/test_training.py: the digits example trained to its accuracy across two nodes;
# the stall and the SIGKILL restarted in place from the snapshot and the checkpoint; the
# custom-script example), so the floor's copies only cost CI minutes. Nor the local runner's stop
# by SIGINT or SIGTERM: it stops its nodes' launchers with SIGTERM, and what torch's version
# changes below them (torchrun's agent and workers stopping) is what test_launcher_signals.py
# runs here at the same moments. Nor the eval of a validation set the world size does not divide:
# test_trainer_exactness's resnet18 eval (37 samples on 2 ranks) runs that same gather here.
FLOOR_DESELECT := $(addprefix --deselect tests/trainer/test_local_runs.py::, \
               test_digits_example_converges_across_two_nodes \
               test_eval_is_exact_when_world_size_does_not_divide_the_validation_set \
               test_ctrl_c_or_sigterm_stops_every_process_within_seconds_on_a_loaded_machine \
               test_frozen_then_sigkilled_rank_1_restarts_the_workers_in_place_and_resumes_from_checkpoint \
               test_custom_script_example_runs_unchanged)
# Nor, for the same reason (each ran 30-130 s of CI's two cores here, rehearsal 40):
# - a user's deadlocked script named by its stacks: the stall found and the worker killed in place
#   on this torch is test_training's frozen worker; the stacks are py-spy's view, not torch's;
# - the saves of a stopped pod judged by the estimate, the measured time or a grace too short: the
#   judgement is our arithmetic (tests/unit/test_trainer_preempt.py runs here), the save is the
#   checkpoint writer test_checkpoint_resume runs here, and a deleted pod saving and resuming on
#   this torch is tests/realpods/test_pod_stop.py;
# - a bad trainer config refused before anything starts: no torch process starts;
# - test_fault_tolerance.py (torchft, per-step): a replica group lost and replaced alone, healed
#   from its peer, is tests/realpods/test_per_step.py on this torch; the Lighthouse lost and back
#   is torchft's quorum and our id folded into it, which no torch version changes.
FLOOR_DESELECT += $(addprefix --deselect tests/trainer/test_local_runs.py::, \
               test_a_users_torchrun_script_that_deadlocks_on_rank_1_is_named_by_its_stacks \
               test_bad_trainer_config_is_refused_before_anything_starts)
FLOOR_DESELECT += $(addprefix --deselect tests/trainer/test_launcher_signals.py::, \
               test_a_pod_stopped_before_its_first_checkpoint_saves_by_the_estimate \
               test_a_pod_stopped_just_after_a_save_saves_by_its_measured_time \
               test_a_pod_whose_save_cannot_fit_in_the_grace_does_not_save_and_says_why)
# Nor (CI's run of stop 69 on a slower machine took 80 minutes; rehearsal 44 there: compile 113 s,
# the resize 179 s of the floor session's 27 minutes):
# - torch.compile: tests/realpods/test_image_features.py trains with it on, inductor compiling in
#   the trainer image's rank, on this torch; the checkpoint's plain keys (the `_orig_mod.` prefix
#   every torch since 2.0 adds) are test_compile's on the newest;
# - a resume at another world size: tests/realpods/test_training.py's elastic job restarts its
#   workers at world size 1, then 2, resuming each time, on this torch; each sample seen once
#   across the resize is our sampler's arithmetic, which test_trainer_exactness checks on the newest.
FLOOR_DESELECT += --deselect \
               tests/trainer/test_trainer_exactness.py::test_resume_grows_and_shrinks_the_world_size_mid_epoch_seeing_every_sample_once
test-floor: install-floor ## the trainer tiers on the trainer image's torch (hack/versions.env)
	$(FLOOR_PY) -m pytest -ra $(PYTEST_ARGS) $(FLOOR_TESTS) $(FLOOR_DESELECT)

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

# The tests that touch API whose shape or behaviour depends on the Kubernetes version, run again on
# a second control plane at the oldest version the chart allows (hack/versions.env
# KUBE_OLDEST_VERSION; Chart.yaml's kubeVersion), with kwok nodes (no real nodes, no Kueue):
# - the CRD: structural schema, CEL rules (the CEL library each version has), printer columns,
#   server-side apply of manifests/ (test_crd, test_chart_manifests' apply);
# - the tenant policy: ValidatingAdmissionPolicy with the authorizer, its CEL (test_tenant_policy, test_tenant_attacks);
# - the pods the operator creates: the full template with native sidecars, topology spread with
#   minDomains, Pod Security admission (test_crd's pod dry runs, test_placement, test_pod_security);
# - gang scheduling with scheduler-plugins' Coscheduling (test_gang, test_gang_scheduler);
# - eviction and node loss: the DisruptionTarget condition (test_node_loss);
# - the Helm install and its kubeVersion check (tests/e2e/test_helm.py);
# - a pod field newer than the API server: refused naming the field and the server's version (test_operator's).
VERSIONED_TESTS := $(addprefix tests/cluster/,test_crd.py test_tenant_policy.py test_tenant_attacks.py test_pod_security.py test_placement.py \
                   test_gang.py test_gang_scheduler.py test_node_loss.py test_create_refused.py) \
                   tests/cluster/test_operator.py::test_a_pod_field_newer_than_the_api_server_is_refused_naming_it_and_the_servers_version \
                   tests/e2e/test_helm.py
test-oldest: install cluster-up-oldest ## the versioned tests on the oldest Kubernetes the chart allows (a second control plane)
	DDPJOB_CLUSTER=oldest $(PY) -m pytest -ra $(PYTEST_ARGS) $(VERSIONED_TESTS)

cluster-up-oldest: build-cluster ## the second control plane, at the oldest Kubernetes the chart allows (.cache/cluster-oldest)
	DDPJOB_CLUSTER=oldest hack/cluster-up.sh

cluster-down-oldest: ## stop the second control plane
	DDPJOB_CLUSTER=oldest hack/cluster-down.sh

lint: install ## ruff, mypy ([tool.ruff], [tool.mypy] in pyproject.toml) and actionlint (.github/workflows/); CI runs it before make test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	"$$(hack/build.sh actionlint)" -no-color

images: install cluster-up ## build localhost/ddpjob/{operator,trainer}:dev with buildah; import into the real nodes
	hack/images.sh all

build-cluster: ## build (or reuse cached) the control plane, kwok, helm, kubelet, CoreDNS
	hack/build.sh all

cluster-up: build-cluster ## control plane + kwok GPU nodes + 2 real nodes (DDPJOB_REAL_NODES=0: none)
	hack/cluster-up.sh

cluster-down: ## stop the local control plane(s) and remove their state
	hack/cluster-down.sh
	DDPJOB_CLUSTER=oldest hack/cluster-down.sh

manifests: install ## regenerate manifests/ from the Helm chart (a test fails when they drift)
	hack/build.sh helm
	hack/gen-manifests.sh

.PHONY: docs
docs: install ## regenerate the chart README, docs/crd-reference.md and the figures README/docs quote from bench/results/ (a test fails when stale)
	$(PY) hack/gen-docs.py

spec: install ## regenerate api/ddpjob_api/specgen.py, the typed spec, from the CRD's schema (a test fails when stale)
	$(PY) hack/gen-spec.py

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

# VERSION must be pyproject's and have a CHANGELOG.md entry; REGISTRY a repository prefix
# (ghcr.io/ddpjob). RELEASE_INSECURE=1: a plain-HTTP registry (loopback). docs/install.md, Releases.
release: install build-cluster ## publish release VERSION to REGISTRY: images, the chart (OCI), wheel and sdist
	hack/release.sh "$(VERSION)" "$(REGISTRY)"

clean: cluster-down ## remove the venv and local caches of this clone
	rm -rf $(VENV) .cache .pytest_cache
