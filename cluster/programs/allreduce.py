"""Runs on every node at once: a real all-reduce over the lab network, checked and timed.

    python allreduce.py --rank R --world N --master ADDR:PORT [--backend gloo|nccl] [--mb 32] [--iters 5]

Each rank contributes (rank + 1); the sum must be N(N+1)/2 everywhere. Prints one
JSON line: bus bandwidth as NCCL-tests defines it (bytes * 2(N-1)/N / time).
"""
import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--mb", type=float, default=32.0)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    dist.init_process_group(a.backend, init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=60))
    device = torch.device("cuda", 0) if a.backend == "nccl" else torch.device("cpu")
    n = int(a.mb * 2**20 / 4)
    x = torch.empty(n, dtype=torch.float32, device=device)
    expected = a.world * (a.world + 1) / 2
    ok, times = True, []
    for i in range(a.iters + 1):  # the first is a warm-up (connection setup)
        x.fill_(a.rank + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
        ok = ok and bool(torch.all(x == expected).item())
    dist.destroy_process_group()
    best = min(times)
    nbytes = n * 4
    busbw = nbytes * 2 * (a.world - 1) / a.world / best if a.world > 1 else 0.0
    print(json.dumps({"rank": a.rank, "world": a.world, "backend": a.backend, "ok": ok, "bytes": nbytes,
                      "best_s": round(best, 4), "median_s": round(sorted(times)[len(times) // 2], 4),
                      "busbw_MBps": round(busbw / 1e6, 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
