#!/bin/sh
# resnet50-ddp: run resnet50-20261129-120000-abcd (node 0 of 4 in inventory order), rendered by clusterctl 0.1.0.
# torchrun joins a c10d rendezvous hosted by the first node at its inventory address; the
# rendezvous gives out the global ranks (torchrun ignores --node-rank outside static rendezvous),
# so CLUSTER_NODE_RANK below records this node's place in the inventory, not its rank.
# is_host says outright which node serves the rendezvous store: torchrun would guess it from the
# hostname, and a Debian PC's hostname resolves to 127.0.1.1, so no node would serve it.
# Each worker's output goes to node.log with its global rank in front ([rank3]:) and to a file of its own
# under the run folder's logs/ (torchrun's --tee). Every value below is shell-quoted.
set -eu
cd -- /srv/cluster
. ./cluster.env
CLUSTER_RUN_ID=resnet50-20261129-120000-abcd
CLUSTER_NODE_NAME=pc1
CLUSTER_NODE_RANK=0
export CLUSTER_RUN_ID CLUSTER_NODE_NAME CLUSTER_NODE_RANK
# Python writes its output as it goes, not at exit: torchrun relays its workers' lines into node.log
# (`logs -f`), and a block-buffered pipe or file would hold them back (a job's env may set it to "")
PYTHONUNBUFFERED=1
export PYTHONUNBUFFERED
OMP_PROC_BIND=close
export OMP_PROC_BIND
cd -- /srv/cluster/runs/resnet50-20261129-120000-abcd
exec "$CLUSTER_PYTHON" -m torch.distributed.run \
  --nnodes 4 --nproc-per-node 2 \
  --rdzv-backend c10d --rdzv-endpoint 192.168.1.11:29400 --rdzv-id resnet50-20261129-120000-abcd \
  --rdzv-conf is_host=1 \
  --max-restarts 0 --local-addr "$CLUSTER_NODE_ADDRESS" \
  --log-dir /srv/cluster/runs/resnet50-20261129-120000-abcd/logs --tee 3 --log-line-prefix-template '[rank${rank}]:' \
  program/train_torch.py --data /srv/cluster/datasets/digits-0123456789abcdef.npz --out out --epochs 2 --batch 32 --lr 0.01 --momentum 0.9 --weight-decay 0.0005 --warmup-epochs 1 --schedule cosine --seed 0 --threads 0 --loader-workers -1 --amp auto --log-every 10 --max-steps 0
