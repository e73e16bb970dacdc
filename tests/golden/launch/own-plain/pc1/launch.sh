#!/bin/sh
# own-plain: run resnet50-20261129-120000-abcd (node 0 of 4), rendered by clusterctl 0.1.0.
# The plain launcher: one process per node, told where it stands by environment variables (docs/jobs.md):
# CLUSTER_NODE_RANK, CLUSTER_NNODES, CLUSTER_NODE_ADDRS (inventory addresses, in rank order),
# CLUSTER_COORDINATOR (the first node's address:port), MASTER_ADDR/MASTER_PORT, RANK and WORLD_SIZE.
# Every value below is shell-quoted.
set -eu
cd -- /srv/cluster
. ./cluster.env
CLUSTER_RUN_ID=resnet50-20261129-120000-abcd
CLUSTER_NODE_NAME=pc1
CLUSTER_NODE_RANK=0
export CLUSTER_RUN_ID CLUSTER_NODE_NAME CLUSTER_NODE_RANK
# JSON lines a program may append ({"step": 3, "loss": 0.4}): `clusterctl report` plots their numbers
CLUSTER_METRICS=/srv/cluster/runs/resnet50-20261129-120000-abcd/out/user-metrics.jsonl
export CLUSTER_METRICS
# Python writes its output as it goes, not at exit: torchrun relays its workers' lines into node.log
# (`logs -f`), and a block-buffered pipe or file would hold them back (a job's env may set it to "")
PYTHONUNBUFFERED=1
export PYTHONUNBUFFERED
cd -- /srv/cluster/runs/resnet50-20261129-120000-abcd
CLUSTER_NNODES=4
CLUSTER_NODE_ADDRS=192.168.1.11,192.168.1.12,192.168.1.13,192.168.1.14
CLUSTER_COORDINATOR=192.168.1.11:29401
MASTER_ADDR=192.168.1.11
MASTER_PORT=29401
RANK=0
WORLD_SIZE=4
export CLUSTER_NNODES CLUSTER_NODE_ADDRS CLUSTER_COORDINATOR MASTER_ADDR MASTER_PORT RANK WORLD_SIZE
# your own program runs in its code folder, as shipped (the run's program/ folder)
cd program
exec "$CLUSTER_PYTHON" plain_job.py