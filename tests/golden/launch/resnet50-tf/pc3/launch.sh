#!/bin/sh
# resnet50-tf: run resnet50-20261129-120000-abcd (worker 2 of 4; worker 0 is the chief), rendered by clusterctl 0.1.0.
# MultiWorkerMirroredStrategy reads the cluster and this worker's index from TF_CONFIG
# (tf_config.json next to this file, written with json.dumps). Every value below is shell-quoted.
set -eu
cd -- '/home/student/cluster work'
. ./cluster.env
CLUSTER_RUN_ID=resnet50-20261129-120000-abcd
CLUSTER_NODE_NAME=pc3
CLUSTER_NODE_RANK=2
export CLUSTER_RUN_ID CLUSTER_NODE_NAME CLUSTER_NODE_RANK
# Python writes its output as it goes, not at exit: torchrun relays its workers' lines into node.log
# (`logs -f`), and a block-buffered pipe or file would hold them back (a job's env may set it to "")
PYTHONUNBUFFERED=1
export PYTHONUNBUFFERED
OMP_PROC_BIND=close
export OMP_PROC_BIND
cd -- '/home/student/cluster work/runs/resnet50-20261129-120000-abcd'
TF_CONFIG=$(cat tf_config.json)
export TF_CONFIG
exec "$CLUSTER_PYTHON" program/train_tf.py --data '/home/student/cluster work/datasets/digits-0123456789abcdef.npz' --out out --epochs 2 --batch 32 --lr 0.01 --momentum 0.9 --weight-decay 0.0005 --warmup-epochs 1 --schedule cosine --seed 0 --threads 0 --loader-workers -1 --amp auto --log-every 10 --max-steps 0
