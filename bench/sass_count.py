"""Count the sm_90 instructions of streamtrain_kernels/adamw_update.py's kernel, on a machine without a GPU.

    python -m bench.sass_count                       # every state format
    python -m bench.sass_count --formats bf16/int8 --ops 25

Triton compiles for a `GPUTarget("cuda", 90, 32)` without a driver, and its wheel carries `ptxas`, `cuobjdump` and
`nvdisasm`, so the SASS a Hopper GPU would run can be read here. The count is of the kernel's path through a full
tile: a copy of the module with `full` fixed to True (no masked tail path), less the instructions of the libdevice
slow paths that `div_rn` / `sqrt_rn` branch to (their call sites, 5 instructions each, and the subroutines after the
kernel's body). It still includes the rarely taken loop of a run boundary inside a tile, so it overstates the
dynamic count by a few instructions per element. Per element = that count over the elements one thread holds.
A proxy for where the time goes when the kernel is bound by instruction issue (int8 moments on an H200): compare
variants with it, then measure on the GPU (bench_adamw_update.py); it does not model latency or occupancy.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FORMATS = ["fp32/fp32", "bf16/fp32", "fp32/bf16", "bf16/bf16", "fp32/int8", "bf16/int8"]
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/")
SLOW_PATH_CALL = 5  # argument moves, CALL, result move, BRA around it


def full_tile_module(source: Path):
    """The kernel module with every tile full: the `if full:` branches fold to their unmasked side."""
    text = source.read_text()
    if "full = rem == TILE" not in text:
        raise SystemExit(f"sass_count: {source} no longer computes `full = rem == TILE`; update full_tile_module")
    path = Path(tempfile.mkdtemp()) / "adamw_full_tile.py"
    path.write_text(text.replace("full = rem == TILE", "full = True"))
    spec = importlib.util.spec_from_file_location("adamw_full_tile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_sm90(mod, master: str, moments: str):
    """(compiled kernel, elements per thread and program) of one format at the launch the module picks for a
    CUDA device."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    code = {"fp32": 0, "bf16": 1, "int8": 2}[moments]
    launch = mod.launch_config(torch.device("cuda"), 256 if moments == "int8" else None)
    R, G, num_warps, maxnreg = launch.rows, launch.groups, launch.num_warps, launch.maxnreg
    fn = mod._adamw_kernel
    ptr = {"p_ptr": "*i16" if master == "bf16" else "*fp32", "m_ptr": ("*fp32", "*i16", "*i8")[code],
           "v_ptr": ("*fp32", "*i16", "*u8")[code], "g_ptr": "*fp32", "w_ptr": "*i16", "ms_ptr": "*fp32",
           "vs_ptr": "*fp32", "gs_ptr": "*fp32", "lr_ptr": "*fp32", "clip_ptr": "*fp32", "run_ptr": "*i64"}
    fp32_args = {"lerp_coef", "beta2", "one_minus_beta2", "eps"}
    const = dict(R=R, G=G, NR_POW2=2, LERP_SMALL=True, MASTER_BF16=master == "bf16",
                 MOMENTS=code, WITH_WEIGHTS=True, GRAD_INT8=False, GRAD_SHIFT=8, GRAD_PER_ROW=False)
    signature = {}
    for name in fn.arg_names:
        signature[name] = (ptr.get(name) or ("constexpr" if name in const else "fp32" if name in fp32_args
                                             else "i32" if name == "n_runs" else "i64"))
    index = {name: i for i, name in enumerate(fn.arg_names)}
    src = ASTSource(fn, signature, {(index[k],): v for k, v in const.items()},
                    {(index[k],): [["tt.divisibility", 16]] for k in ptr})
    options = dict(num_warps=num_warps, enable_fp_fusion=False, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel, R * G * 8 / (32 * num_warps)


def nvidia_tools_dir() -> Path:
    """Where the triton wheel keeps ptxas, cuobjdump and nvdisasm (absent from a wheel without the NVIDIA backend)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def nvidia_tool(name: str) -> str:
    tool = nvidia_tools_dir() / name
    if not tool.exists():
        raise SystemExit(f"sass_count: {tool} is missing; this triton wheel does not carry the NVIDIA tools")
    return str(tool)


def analyse(kernel) -> dict:
    """Registers, and the instructions of the kernel's body (before its first slow-path subroutine)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([nvidia_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()
        usage = subprocess.run([nvidia_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    subroutines = [i for i, line in enumerate(sass) if "__internal" in line and line.strip().endswith(":")]
    body = [line for line in sass[:subroutines[0] if subroutines else len(sass)] if INSTRUCTION.match(line)]
    ops = collections.Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0] for line in body)
    calls = sum("CALL" in line for line in body)
    # stack_bytes > 0: registers spilled under the register cap, or call frames
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "instructions": len(body) - SLOW_PATH_CALL * calls, "ops": ops}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="master/moments pairs, e.g. bf16/int8,fp32/fp32")
    ap.add_argument("--ops", type=int, default=0, help="also print the N most frequent opcodes of each format")
    ap.add_argument("--json", action="store_true", help="one JSON row per format instead of the table")
    args = ap.parse_args(argv)
    # compiling needs real JIT functions: under TRITON_INTERPRET=1 (the CPU test setting) @triton.jit builds
    # interpreter objects that cannot be compiled for a GPU target; set before the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "0"
    formats = args.formats.split(",")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"sass_count: unknown format(s) {bad}; choose from {FORMATS}")
    mod = full_tile_module(ROOT / "streamtrain_kernels" / "adamw_update.py")
    if not args.json:
        print(f"{'format':10} {'registers':>9} {'stack B':>7} {'instr/thread':>12} {'elem/thread':>11} "
              f"{'instr/elem':>10}")
    for fmt in formats:
        kernel, per_thread = compile_sm90(mod, *fmt.split("/"))
        a = analyse(kernel)
        if args.json:
            print(json.dumps({"format": fmt, "registers": a["registers"], "stack_bytes": a["stack_bytes"],
                              "instructions": a["instructions"],
                              "elements_per_thread": per_thread, "ops": dict(a["ops"])}))
            continue
        print(f"{fmt:10} {a['registers']:>9} {a['stack_bytes']:>7} {a['instructions']:>12} {per_thread:>11.0f} "
              f"{a['instructions'] / per_thread:>10.1f}")
        if args.ops:
            print("   ", ", ".join(f"{op} {n}" for op, n in a["ops"].most_common(args.ops)))


if __name__ == "__main__":
    main()
