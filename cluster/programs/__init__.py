"""The programs clusterctl runs on the nodes: the built-in training programs (ResNet50 and any torchvision
network on PyTorch DDP and TensorFlow MultiWorkerMirroredStrategy, with their data, metrics and
communication schemes) and the all-reduce test provision and bench run. The standard library and the
frameworks only: no clusterctl imports.

Takes in: the files launch renders (launch.sh, job.json, TF_CONFIG) and its command-line arguments.
Gives out: training runs, metrics JSONL, checkpoints and exit codes.
Must never import: anything of the head's library, not even cluster.errors (it is shipped to the node alone).
"""
