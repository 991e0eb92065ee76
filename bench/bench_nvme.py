"""The NVMe tier's disk path (engine/streaming/nvme.py) measured on this machine: bandwidth and page-cache growth.

One optimizer pass's traffic, without the optimizer: for each of `--units` units of `--unit-mparams` million
parameters (fp32 m + v: 8 bytes each), read it into a staging buffer, touch it, write it back, with the tier's own
pipeline (next unit's read and previous unit's write in flight while one is "updated"). Reported per mode (direct
I/O, buffered with pages dropped): GB/s of reads + writes over the pass, and how much the kernel's page cache
(`Cached` in /proc/meminfo) grew during it, which is what the tier must keep small.

    python -m bench.bench_nvme --dir /path/on/nvme --out bench/results/nvme_<gpu>_<date>.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.metrics import run_environment
from engine.streaming.nvme import MomentFile, NvmeError


def cached_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def one_pass(f: MomentFile) -> float:
    start = time.perf_counter()
    f.prefetch(f.units[0])
    for i, u in enumerate(f.units):
        m, v = f.acquire(u)
        if i + 1 < len(f.units):
            f.prefetch(f.units[i + 1])
        m[:1].add_(1.0)
        v[:1].add_(1.0)
        f.release(u)
    f.drain()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--unit-mparams", type=float, default=233.1, help="parameters per unit, millions (qwen7b layer)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", help="JSONL file the rows are appended to")
    args = ap.parse_args()
    numel = int(args.unit_mparams * 1e6)
    meta = run_environment()
    rows = []
    for direct in (True, False):
        row = {"bench": "nvme", "direct_io": direct, "units": args.units, "unit_params": numel, **meta}
        try:
            f = MomentFile(args.dir, {u: numel for u in range(args.units)}, direct_io=direct)
        except NvmeError as e:
            rows.append({**row, "error": str(e)})
            print(f"direct_io={direct}: {e}")
            continue
        try:
            io_bytes = 2 * f.size  # every unit read and written once per pass
            one_pass(f)  # the file's first touch
            before = cached_gib()
            seconds = [one_pass(f) for _ in range(args.passes)]
            growth = cached_gib() - before
        finally:
            f.close()
        best = min(seconds)
        row.update(file_gib=f.size / 2**30, pass_s=seconds, io_gbps=io_bytes / best / 1e9,
                   page_cache_growth_gib=growth)
        rows.append(row)
        print(f"direct_io={direct}: {f.size / 2**30:.1f} GiB file, pass {best:.2f} s, "
              f"{row['io_gbps']:.2f} GB/s read + write, page cache grew {growth:+.2f} GiB")
    if args.out:
        with open(args.out, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
