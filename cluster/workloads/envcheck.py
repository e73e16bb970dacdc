"""Runs on a node with the environment's Python: prints the fingerprint `provision` compares, as JSON."""
import json
import platform
import sys
import sysconfig
import time

out = {"python": platform.python_version(), "purelib": sysconfig.get_paths()["purelib"], "errors": {}}
start = time.time()
try:
    import torch

    out["torch"] = torch.__version__
    out["cuda_available"] = torch.cuda.is_available()
    out["cuda"] = torch.version.cuda
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001
        out["nccl"] = None
        out["errors"]["nccl"] = repr(e)
    out["gloo"] = torch.distributed.is_gloo_available()
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if out["cuda_available"] else []
except Exception as e:  # noqa: BLE001 - report, don't crash: the head shows it per node
    out["torch"] = None
    out["errors"]["torch"] = repr(e)
try:
    import torchvision

    out["torchvision"] = torchvision.__version__
except Exception as e:  # noqa: BLE001
    out["torchvision"] = None
    out["errors"]["torchvision"] = repr(e)
try:
    import tensorflow as tf

    out["tensorflow"] = tf.__version__
    info = tf.sysconfig.get_build_info()
    out["tf_cuda"] = info.get("cuda_version")
    out["tf_cudnn"] = info.get("cudnn_version")
    out["tf_gpus"] = len(tf.config.list_physical_devices("GPU"))
except Exception as e:  # noqa: BLE001
    out["tensorflow"] = None
    out["errors"]["tensorflow"] = repr(e)
out["import_s"] = round(time.time() - start, 2)
sys.stdout.write(json.dumps(out) + "\n")
