#!/usr/bin/env bash
# Installs what clusterctl, its demo and its tests need on a fresh Debian machine:
# Debian packages (sshd and iproute2 for the simulated lab, pdsh for the benchmark,
# chromium to check in a real browser that the HTML report renders, nftables for the firewall check's
# test, which puts rules inside a lab node's own network namespace; sudo for the lab's non-root login user)
# and the Python environment in .venv. Safe to re-run: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
APT_PKGS="python3 python3-venv openssh-server openssh-client iproute2 util-linux procps pdsh chromium nftables sudo slurmctld slurmd slurm-client munge"
missing=""
for p in $APT_PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)" >&2
  $PY -m venv .venv
fi
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat .venv/.setup-stamp 2>/dev/null)" != "$want" ]; then
  # The frameworks too: the tests run the training programs on the head (torch ~5 GB, from this
  # machine's disk where it lies there, else PyPI).
  echo "setup: installing clusterctl, PyTorch, TensorFlow and the test tools into .venv (a few minutes)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,torch,tf,workloads,ansible]'
  echo "$want" > .venv/.setup-stamp
fi
