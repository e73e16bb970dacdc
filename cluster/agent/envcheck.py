"""Runs on a node with the environment's Python: prints the fingerprint `provision` compares, as JSON."""
from __future__ import annotations

import json
import platform
import sys
import sysconfig
import time
from typing import Any


def probe_torch(out: dict[str, Any], errors: dict[str, str]) -> None:
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda_available"] = torch.cuda.is_available()
        out["cuda"] = torch.version.cuda
        # torch leaves cudnn.version, cudnn.is_available and nccl.version unannotated
        cudnn = torch.backends.cudnn
        out["cudnn"] = cudnn.version() if cudnn.is_available() else None  # type: ignore[no-untyped-call]
        try:
            nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None  # type: ignore[no-untyped-call]
            out["nccl"] = ".".join(map(str, nccl)) if nccl is not None else None
        except Exception as e:  # noqa: BLE001
            out["nccl"] = None
            errors["nccl"] = repr(e)
        out["gloo"] = torch.distributed.is_gloo_available()
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
            if out["cuda_available"] else []
    except Exception as e:  # noqa: BLE001 - report, don't crash: the head shows it per node
        out["torch"] = None
        errors["torch"] = repr(e)


def probe_torchvision(out: dict[str, Any], errors: dict[str, str]) -> None:
    try:
        import torchvision  # type: ignore[import-untyped]  # publishes no type information

        out["torchvision"] = torchvision.__version__
    except Exception as e:  # noqa: BLE001
        out["torchvision"] = None
        errors["torchvision"] = repr(e)


def probe_tensorflow(out: dict[str, Any], errors: dict[str, str]) -> None:
    try:
        import tensorflow as tf

        out["tensorflow"] = tf.__version__
        info = tf.sysconfig.get_build_info()
        out["tf_cuda"] = info.get("cuda_version")
        out["tf_cudnn"] = info.get("cudnn_version")
        out["tf_gpus"] = len(tf.config.list_physical_devices("GPU"))
    except Exception as e:  # noqa: BLE001
        out["tensorflow"] = None
        errors["tensorflow"] = repr(e)


def main() -> None:
    errors: dict[str, str] = {}
    out: dict[str, Any] = {"python": platform.python_version(), "purelib": sysconfig.get_paths()["purelib"],
                           "errors": errors}
    start = time.time()
    probe_torch(out, errors)
    probe_torchvision(out, errors)
    probe_tensorflow(out, errors)
    out["import_s"] = round(time.time() - start, 2)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
