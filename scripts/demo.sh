#!/usr/bin/env bash
# The demo: set everything up, start a simulated 3-node lab (network namespaces,
# one sshd each, 1 GbE links behind the head's one 1 GbE uplink, no internet), check it, run a command on every node,
# provision PyTorch + TensorFlow on every node from the head's wheelhouse (the first
# time downloads ~4 GB once, then installs on each node: several minutes), show that
# a second provision has nothing to do, train ResNet50 on the digits dataset with
# PyTorch DDP and with TensorFlow MultiWorkerMirroredStrategy on one node and on all 3
# (`clusterctl study`: a live table per run, every node's results collected on the head),
# write the comparison report against one node (demo-report.html), tear the lab down.
# Without root or network namespaces it runs on the embedded local inventory instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
CTL=.venv/bin/clusterctl
LAB=demo
CLUSTERCTL_REPORT=${CLUSTERCTL_REPORT:-$PWD/demo-report.html}

set +e
$CTL lab up 3 --name "$LAB" --subnet 10.77.0.0/24 --bandwidth 1gbit --uplink 1gbit
rc=$?
set -e
if [ "$rc" -eq 4 ]; then
  echo
  echo "The simulated lab cannot start here (see above): running on inventory/local.yaml instead."
  $CTL check -i inventory/local.yaml
  $CTL exec -i inventory/local.yaml -- 'echo "$(hostname): $(nproc) cores, $(uname -r)"'
  $CTL provision -i inventory/local.yaml --dry-run
  exit 0
elif [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
# --purge: the nodes' venvs (~8 GB each) go with the lab; the head's wheelhouse cache stays for a rerun.
trap '$CTL lab down --name "$LAB" --purge
      [ -f "$CLUSTERCTL_REPORT" ] && echo && echo "The report is $CLUSTERCTL_REPORT: open it in a browser."' EXIT

echo; echo "== clusterctl check   (facts and problems of every node)"
$CTL check
echo; echo "== clusterctl exec -- hostname   (one command on all nodes)"
$CTL exec -- 'echo "$(hostname): $(nproc) cores, $(python3 -V), kernel $(uname -r)"'
echo; echo "== clusterctl provision   (fresh venv per node from the head's wheelhouse, verified)"
$CTL provision
echo; echo "== clusterctl provision again   (idempotent: only checks)"
$CTL provision
# The 3 simulated nodes share this machine's cores: one thread per training process, and 3 epochs
# (the report says how many each run trained) keep the demo short.
echo; echo "== clusterctl study resnet50-ddp resnet50-tf --nodes 1,3   (PyTorch DDP and TensorFlow MWMS on one node and on all three)"
$CTL study resnet50-ddp resnet50-tf --nodes 1,3 --set epochs=3 --set threads=1
echo; echo "== clusterctl runs"
$CTL runs
RUNS=$($CTL runs --json | .venv/bin/python -c 'import json, sys; print(" ".join(r["run_id"] for r in json.load(sys.stdin)[-4:]))')
echo; echo "== clusterctl report   (each framework against its one-node run: scaling, speed-up, time to target)"
$CTL report $RUNS --html "$CLUSTERCTL_REPORT"
echo "The lab's three nodes share this machine's cores: their scaling shows the method, not what a room of PCs gives."
echo; echo "== clusterctl lab down   (nothing left behind)"
