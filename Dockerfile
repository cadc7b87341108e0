# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t <registry>/operator:<tag> .
#   docker build --target trainer  -t <registry>/trainer:<tag> .
# The operator image is slim Python with only the operator's dependencies (no torch); the
# trainer image is a CUDA PyTorch base plus the ddpjob package and its in-pod launcher.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Any CUDA runtime image of PyTorch >= 2.3 works; pick one whose CUDA matches your drivers.
ARG TORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

# --- wheel: build the ddpjob wheel once (pure Python), for both images ----------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY api/ api/
COPY operator/ operator/
COPY trainer/ trainer/
COPY cli/ cli/
# The packages' crds/ links point here: the trainer validates spec.trainer against this CRD's schema.
COPY charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml charts/ddpjob-operator/crds/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- operator: `ddpjob operator`, non-root, read-only-root-filesystem friendly --------------
FROM ${PYTHON_IMAGE} AS operator
# MALLOC_ARENA_MAX: glibc gives each thread that allocates an arena of its own (up to 8 per core);
# the operator's informer, API and parse threads each decode watch events and responses, and every
# arena keeps its free pages. Two arenas kept its RSS with 10,000 pods about a tenth lower
# (bench/results/operator_memory_arena.json); read at start, so it is set here, not in Python.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MALLOC_ARENA_MAX=2
COPY requirements/operator.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
# --no-deps: the wheel's full dependency list includes torch, which the operator never imports.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps /wheels/*.whl
# The DDPJob CRD: `ddpjob render` validates jobs against its schema (found via DDPJOB_CRD_PATH
# outside a source checkout).
COPY charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml /usr/local/share/ddpjob/ddpjobs.ddpjob.dev.yaml
ENV DDPJOB_CRD_PATH=/usr/local/share/ddpjob/ddpjobs.ddpjob.dev.yaml
RUN groupadd --system --gid 10001 ddpjob \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin ddpjob
USER 10001:10001
# 8080: Prometheus metrics; 8081: /healthz (liveness/readiness).
EXPOSE 8080 8081
ENTRYPOINT ["ddpjob"]
CMD ["operator", "--all-namespaces"]

# --- trainer: what every DDPJob pod runs -------------------------------------------------------
FROM ${TORCH_IMAGE} AS trainer
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/ddpjob
# spec.trainer.compile: torch.compile builds kernels when the job runs, inductor's CPU code with g++
# against Python.h, triton's GPU launchers with gcc; runtime bases ship neither compiler. Headers
# come from the distro's python3-dev only when the interpreter is the distro's (pytorch/pytorch's
# conda Python has its own). Not pinned (DL3008): the versions are those of whichever distro
# TORCH_IMAGE is built on (Ubuntu upstream, Debian for the real nodes of `make images`).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ \
 && if [ ! -e "$(python -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ]; then \
      apt-get install -y --no-install-recommends python3-dev; fi \
 && rm -rf /var/lib/apt/lists/*
# Keep the base image's CUDA builds of torch/torchvision: pip may add, never replace them.
# mlflow-skinny: the MLflow client alone, for spec.trainer.mlflow (the server is not needed in a pod);
# its version is hack/versions.env's MLFLOW_VERSION, pyproject's floor (tests/unit/test_versions.py).
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip freeze | grep -iE '^(torch|torchvision|torchaudio)==' > /tmp/keep-torch.txt \
 && whl="$(echo /wheels/ddpjob-*.whl)" \
 && pip install --no-cache-dir -c /tmp/keep-torch.txt "${whl}[trainer]" mlflow-skinny==3.17.2 \
 && rm /tmp/keep-torch.txt \
 && python -c "import ddpjob_trainer.launch.node, mlflow, torch; print('torch', torch.__version__)" \
 && python -c "from ddpjob_trainer.config import parse_config; parse_config({})" \
 && TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-check python -c \
      "import torch; assert torch.compile(lambda x: x.sin() + 1)(torch.ones(4)).shape == (4,)" \
 && rm -rf /tmp/inductor-check
COPY charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml /usr/local/share/ddpjob/ddpjobs.ddpjob.dev.yaml
ENV DDPJOB_CRD_PATH=/usr/local/share/ddpjob/ddpjobs.ddpjob.dev.yaml
RUN groupadd --gid 10001 ddpjob \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/ddpjob --shell /bin/bash ddpjob
WORKDIR /home/ddpjob
USER 10001:10001
# The operator sets the pod command to ["python", "-m", "ddpjob_trainer.launch", "--", ...];
# the same entrypoint makes `docker run IMAGE` run the built-in trainer (torchrun, PET_* env)
# and `docker run IMAGE torchrun train.py` run a custom script under the launcher.
ENTRYPOINT ["python", "-m", "ddpjob_trainer.launch", "--"]
CMD []
