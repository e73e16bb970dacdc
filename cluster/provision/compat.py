"""Which PyTorch / TensorFlow build each node can run, from its GPU and driver.

The facts are data with their sources (../shared/COMPAT-FACTS.md, September 2026);
what is inferred rather than tested on a GPU says so. `node_options` finds every
build a node can run; `choose_builds` picks one version of each framework that all
nodes share (mixed versions hang or corrupt collectives) and the backend every
rank must use: the cluster's BuildChoice, which provision installs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, cast

from cluster.errors import ClusterError

SRC_TORCH = ("pytorch/pytorch .ci/manywheel/build_cuda.sh; pytorch/builder manywheel/build_cuda.sh; "
             "pytorch/pytorch #160269 #182250 #178665 #190355, PR #164471 #175253")
SRC_DRIVER = "CUDA toolkit release notes, tables 2/3; NVIDIA minor-version compatibility page"
SRC_TF = "build_info.py in the tensorflow PyPI wheels; TF 2.17.0 release notes; cuDNN support matrix"
SRC_AMP = "CUDA C Programming Guide, arithmetic instruction throughput table"

# Driver needed by a CUDA runtime with minor-version compatibility (SRC_DRIVER).
MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450.80.02", 12: "525.60.13", 13: "580.0"}
LAST_DRIVER_BRANCH_FOR_OLD_ARCHS = 580  # R580 is the last for Maxwell, Pascal, Volta (cc < 7.5); 590+ drops them
RECOMMENDED_DRIVER = "580.95.05"  # R580: long-term branch, end of life August 2028; proprietary modules pre-Turing
AMP_MIN_CC = (7, 0)  # tensor cores from Volta; cc 6.1 runs fp16 at 1/64 of fp32 (SRC_AMP)


@dataclass(frozen=True)
class TorchBuild:
    version: str
    variant: str  # cu118 | cu126 | cu130 | cpu
    torchvision: str
    archs: tuple[str, ...] = ()  # SASS built; sm_X.0 runs on X.y of the same generation
    ptx: str | None = None  # PTX included for JIT on newer archs
    source: str = SRC_TORCH

    @property
    def cuda_major(self) -> int | None:
        return int(self.variant[2:4]) if self.variant.startswith("cu") else None

    @property
    def index_url(self) -> str:
        return f"https://download.pytorch.org/whl/{self.variant}"


@dataclass(frozen=True)
class TFBuild:
    version: str
    archs: tuple[str, ...]
    ptx: str | None
    cuda: str
    cudnn: str
    nccl: str
    source: str = SRC_TF


# Newest first: a node's preferred build is the first it can run.
TORCH_BUILDS: tuple[TorchBuild, ...] = (
    # cu126: the last line with Maxwell/Pascal/Volta SASS (a proposal removes it in 2.15).
    TorchBuild("2.14.1", "cu126", "0.29.1", ("5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0")),
    TorchBuild("2.14.1", "cu130", "0.29.1", ("7.5", "8.0", "8.6", "9.0", "10.0", "12.0"), ptx="12.0"),
    # cu118 ended with 2.7.x: the only build an R470 driver (CUDA 11.4) can run, via minor-version compat.
    TorchBuild("2.7.1", "cu118", "0.22.1", ("3.7", "5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0")),
)
TORCH_CPU: dict[str, TorchBuild] = {
    b.version: TorchBuild(b.version, "cpu", b.torchvision) for b in TORCH_BUILDS
}

TF_BUILDS: tuple[TFBuild, ...] = (
    TFBuild("2.21.0", ("6.0", "7.0", "8.0", "8.9", "9.0"), "9.0", "12.5.1", ">=9.3.0.75,<10", ">=2.25.1"),
    TFBuild("2.16.2", ("5.0", "6.0", "7.0", "8.0", "9.0"), "9.0", "12.3", "8.9.7.29", "2.19.3"),
)
TF_CPU_VERSIONS = ("2.21.0", "2.16.2")
# cuDNN 9.11+ dropped Maxwell/Pascal/Volta; TF 2.20+ allows cuDNN up to <10, so pin below 9.11 there.
# NOTE: inferred from those two facts, not yet tested on a GPU (COMPAT-FACTS.md).
CUDNN_PIN_PRE_TURING = "nvidia-cudnn-cu12<9.11"


def _cc(value: str) -> tuple[int, int]:
    major, _, minor = value.partition(".")
    return int(major), int(minor or 0)


def _driver(value: str) -> tuple[int, ...]:
    return tuple(int(x) for x in value.split(".") if x.isdigit())


def runs_on(archs: Iterable[str], ptx: str | None, cc: str) -> bool:
    """SASS for X.0..X.y of the card's generation, or PTX it can JIT from (an older PTX arch)."""
    c = _cc(cc)
    if any(_cc(a)[0] == c[0] and _cc(a)[1] <= c[1] for a in archs):
        return True
    return ptx is not None and _cc(ptx) <= c


def driver_ok(driver: str, cuda_major: int) -> bool:
    return _driver(driver) >= _driver(MIN_DRIVER_FOR_CUDA_MAJOR[cuda_major])


@dataclass
class NodeOptions:
    """Every build one node could run, or why it can run none (refusal + fix)."""

    host: str
    gpu: str | None
    compute_capability: str | None
    driver: str | None
    torch_options: list[TorchBuild] = field(default_factory=list)  # runnable builds, preferred first
    tf_gpu_options: list[TFBuild] = field(default_factory=list)
    amp: bool = False
    refusal: str | None = None
    fix: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.refusal is None


def node_options(host: str, gpus: list[dict[str, Any]]) -> NodeOptions:
    """Every build this node can run. `gpus`: facts' GPU list (name, compute_capability, driver)."""
    if not gpus:
        return NodeOptions(host, None, None, None, torch_options=list(TORCH_CPU.values()),
                           notes=["no GPU: CPU builds, gloo"])
    g = gpus[0]
    name, cc = g["name"], g.get("compute_capability")
    driver = cast(str, g.get("driver"))  # facts give every GPU its driver version (nvidia-smi's driver_version)
    opts = NodeOptions(host, name, cc, driver)
    if cc is None:
        opts.refusal = f"compute capability of {name} is unknown (nvidia-smi gave none and the name is not in the table)"
        opts.fix = "set it in the inventory: gpu: {compute_capability: \"6.1\"}"
        return opts
    if len({(x["name"], x.get("compute_capability")) for x in gpus}) > 1:
        opts.notes.append("several GPU models in one node: planned for the first, "
                          + ", ".join(x["name"] for x in gpus))
    if _cc(cc) < (7, 5) and _driver(driver)[0] > LAST_DRIVER_BRANCH_FOR_OLD_ARCHS:
        opts.refusal = (f"driver {driver} does not support {name} (compute capability {cc}): branches after "
                        f"R{LAST_DRIVER_BRANCH_FOR_OLD_ARCHS} dropped Maxwell, Pascal and Volta")
        opts.fix = (f"install the R580 driver ({RECOMMENDED_DRIVER} or a newer 580.x; proprietary kernel modules), "
                    "supported until August 2028")
        return opts
    opts.torch_options = [b for b in TORCH_BUILDS
                          if runs_on(b.archs, b.ptx, cc) and driver_ok(driver, b.cuda_major or 0)]
    if not opts.torch_options:
        arch_ok = [b for b in TORCH_BUILDS if runs_on(b.archs, b.ptx, cc)]
        if arch_ok:
            need = min(MIN_DRIVER_FOR_CUDA_MAJOR[b.cuda_major or 0] for b in arch_ok)
            opts.refusal = f"driver {driver} is too old for every PyTorch build for {name} (needs >= {need})"
            opts.fix = f"install the R580 driver ({RECOMMENDED_DRIVER})"
        else:
            opts.refusal = (f"no supported PyTorch build runs on {name} (compute capability {cc}); "
                            "the oldest builds start at 3.7 (cu118) and 5.0 (cu126)")
            opts.fix = "use this PC as a CPU-only node: gpu: none in the inventory"
        return opts
    opts.tf_gpu_options = [t for t in TF_BUILDS if runs_on(t.archs, t.ptx, cc) and driver_ok(driver, 12)]
    if not opts.tf_gpu_options:
        opts.notes.append(f"TensorFlow runs on the CPU here: its CUDA 12 builds need driver >= "
                          f"{MIN_DRIVER_FOR_CUDA_MAJOR[12]} and one built for cc {cc}")
    opts.amp = _cc(cc) >= AMP_MIN_CC
    return opts


@dataclass
class NodeBuild:
    """What one node installs, after the cluster agreed on versions."""

    host: str
    torch: str
    torch_variant: str
    torchvision: str
    torch_index: str | None
    tensorflow: str
    tf_package: str  # tensorflow[and-cuda] | tensorflow-cpu
    tf_on_gpu: bool
    pins: list[str]
    backend: str
    amp: bool
    gpu: str | None
    compute_capability: str | None
    driver: str | None
    notes: list[str]

    @property
    def torch_label(self) -> str:
        return f"{self.torch}+{self.torch_variant}" if self.torch_index else f"{self.torch} (default index)"

    def requirements(self) -> list[str]:
        """pip requirement lines (the index choice is the wheelhouse's job)."""
        torch = self.torch if self.torch_index is None else f"{self.torch}+{self.torch_variant}"
        return [f"torch=={torch}", f"torchvision=={self.torchvision}" + (
                    "" if self.torch_index is None else f"+{self.torch_variant}"),
                f"{self.tf_package}=={self.tensorflow}", f"tf-keras=={self.tensorflow.rsplit('.', 1)[0]}.*",
                *self.pins]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BuildChoice:
    """The cluster's builds: one torch and one TF version for all, each node's packages, the backend."""

    nodes: dict[str, NodeOptions]
    builds: dict[str, NodeBuild]
    backend: str
    torch: str | None
    tensorflow: str | None
    refused: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "torch": self.torch, "tensorflow": self.tensorflow,
                "nodes": {h: b.to_dict() for h, b in self.builds.items()},
                "refused": {h: {"reason": r, "fix": self.nodes[h].fix} for h, r in self.refused.items()}}


def choose_builds(options: list[NodeOptions], torch_index: str | None = "pytorch") -> BuildChoice:
    """One torch and one TF version for all nodes that can run any; the backend all ranks share.

    `torch_index`: "pytorch" (download.pytorch.org, per-variant local versions) or None
    (the default index's plain `torch==X`, e.g. a mirror of PyPI).
    """
    usable = [p for p in options if p.ok]
    refused = {p.host: p.refusal or "" for p in options if not p.ok}
    if not usable:
        return BuildChoice({p.host: p for p in options}, {}, "gloo", None, None, refused)
    common = [v for v in dict.fromkeys(b.version for b in TORCH_BUILDS)
              if all(any(o.version == v for o in p.torch_options) for p in usable)]
    if not common:
        raise ClusterError("no PyTorch version runs on every node: "
                           + "; ".join(f"{p.host}: {', '.join(sorted({o.version for o in p.torch_options}))}"
                                       for p in usable),
                           "update the oldest drivers to R580 so every node can run the same build")
    torch_v = common[0]
    gpu_nodes = [p for p in usable if p.gpu]
    # Newest TF every GPU node can run on its GPU; if none, the newest, with GPU-less nodes on the CPU.
    tf_v = next((t.version for t in TF_BUILDS if all(any(o.version == t.version for o in p.tf_gpu_options)
                                                     for p in gpu_nodes)), TF_BUILDS[0].version)
    backend = "nccl" if usable and all(p.gpu for p in usable) else "gloo"
    builds = {}
    for p in usable:
        tb = next(o for o in p.torch_options if o.version == torch_v)
        tf_gpu = next((o for o in p.tf_gpu_options if o.version == tf_v), None)
        notes = list(p.notes)
        pins = []
        if tf_gpu is not None and p.compute_capability and _cc(p.compute_capability) < (7, 5) \
                and _driver(tf_gpu.version) >= (2, 20):
            pins.append(CUDNN_PIN_PRE_TURING)
            notes.append("cuDNN pinned below 9.11 (dropped pre-Turing GPUs); inferred, untested on a GPU")
        if p.gpu and tf_gpu is None:
            notes.append(f"TensorFlow {tf_v} runs on the CPU on this node")
        if p.gpu and backend == "gloo":
            notes.append("gloo for every rank: the cluster has CPU-only nodes")
        builds[p.host] = NodeBuild(
            host=p.host, torch=tb.version, torch_variant=tb.variant, torchvision=tb.torchvision,
            torch_index=tb.index_url if torch_index == "pytorch" else None, tensorflow=tf_v,
            tf_package="tensorflow[and-cuda]" if tf_gpu else "tensorflow-cpu", tf_on_gpu=tf_gpu is not None,
            pins=pins, backend=backend, amp=p.amp, gpu=p.gpu, compute_capability=p.compute_capability,
            driver=p.driver, notes=notes)
    return BuildChoice({p.host: p for p in options}, builds, backend, torch_v, tf_v, refused)
