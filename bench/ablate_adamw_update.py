"""Time variants of streamtrain_kernels/adamw_update.py side by side in one process: patched copies of the module.

    python -m bench.ablate_adamw_update --out bench/results/adamw_ablation.jsonl
    python -m bench.ablate_adamw_update --variants shipped,no_register_cap --base-tree /tmp/base --out ...

Each variant is the module's source with one textual change (VARIANTS: name -> (what it changes, old, new)),
written to a temporary file and imported as a module of its own, so its Triton kernel compiles apart from the
shipped one. `--base-tree DIR` adds the kernel of another checkout (e.g. `git archive <sha> | tar x -C DIR`) as
variant `base`. Every variant runs one AdamW step over the same qwen7b layer-sized state (`--model`), in each
format of `--formats`, timed with triton.testing.do_bench; `frac_of_copy` is a device-to-device copy of the same
bytes over the kernel's time, as in bench_adamw_update.py (which also checks the bits: this script does not).
Rows carry the variant, its description and `engine.metrics.run_environment`. Needs a GPU. A patch whose text is
no longer in the source fails before anything runs, naming the variant.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

from bench.bench_adamw_update import copy_time_ms, make_state, step_fn, timer, update_bytes
from bench.kernel_bench import ROOT, layer_layout, require_gpu

SOURCE = ROOT / "streamtrain_kernels" / "adamw_update.py"
# where a checkout keeps the kernel: trees older than the streamtrain_kernels package kept it under engine/
KERNEL_PLACES = ("streamtrain_kernels/adamw_update.py", "engine/kernels/adamw_update.py")
FORMATS = ["bf16/int8", "fp32/int8", "bf16/bf16", "fp32/fp32", "bf16/fp32", "fp32/bf16"]
VARIANTS = {
    "shipped": ("the module as it is", None, None),
    "no_register_cap": ("int8 launches without the register cap",
                        "maxnreg = None if block_size is None else MAX_REGISTERS_INT8", "maxnreg = None"),
    "register_cap_64": ("int8 launches capped at 64 registers", "MAX_REGISTERS_INT8 = 56",
                        "MAX_REGISTERS_INT8 = 64"),
    "register_cap_48": ("int8 launches capped at 48 registers", "MAX_REGISTERS_INT8 = 56", "MAX_REGISTERS_INT8 = 48"),
    "register_cap_all": ("every format's launch capped at 56 registers",
                         "maxnreg = None if block_size is None else MAX_REGISTERS_INT8",
                         "maxnreg = MAX_REGISTERS_INT8"),
    "div_rn_bc2": ("sqrt(v) / sqrt(bc2) by div_rn instead of the fp64 product",
                   "_div_by_constant(tl.math.sqrt_rn(v), inv_bc2)",
                   "tl.math.div_rn(tl.math.sqrt_rn(v), (1.0 / inv_bc2).to(tl.float32))"),
}


def variant_sources(names, base_tree: Path | None) -> dict:
    """name -> (description, source text); a patch that does not apply is an error before any timing."""
    text = SOURCE.read_text()
    out = {}
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"ablate_adamw_update: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        desc, old, new = VARIANTS[name]
        if old is not None and old not in text:
            raise SystemExit(f"ablate_adamw_update: variant {name!r} no longer applies: {old!r} is not in {SOURCE}")
        out[name] = (desc, text if old is None else text.replace(old, new))
    if base_tree is not None:
        base = next((base_tree / place for place in KERNEL_PLACES if (base_tree / place).exists()), None)
        if base is None:
            raise SystemExit(f"ablate_adamw_update: --base-tree {base_tree} has none of {', '.join(KERNEL_PLACES)}")
        out["base"] = (f"the kernel of {base_tree}", base.read_text())
    return out


def load(name: str, text: str):
    path = Path(tempfile.mkdtemp()) / f"adamw_update_{name}.py"
    path.write_text(text)  # Triton reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location(f"adamw_update_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--model", default="qwen7b", help="decoder-layer size of this model (kernel_bench.layer_layout)")
    ap.add_argument("--base-tree", type=Path, default=None, help="also time the kernel of this checkout")
    args = ap.parse_args(argv)
    bad = [f for f in args.formats.split(",") if f not in FORMATS]
    if bad:
        raise SystemExit(f"ablate_adamw_update: unknown format(s) {bad}; choose from {FORMATS}")
    sources = variant_sources(args.variants.split(","), args.base_tree)
    torch, _ = require_gpu("ablate_adamw_update")
    from streamtrain_kernels.adamw_update import layout_segments
    from engine.metrics import run_environment

    layout = layer_layout(args.model)
    segments = layout_segments(layout, 0.1)
    modules = {name: load(name, text) for name, (_, text) in sources.items()}
    time_ms = timer("cuda")
    lr, clip = torch.tensor(1e-4, device="cuda"), torch.tensor(0.5, device="cuda")
    env = run_environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for fmt in args.formats.split(","):
            master, moments = fmt.split("/")
            st = make_state(torch, layout.numel, master, moments, "cuda")
            copy_ms = copy_time_ms(torch, update_bytes(layout.numel, master, moments), "cuda", time_ms)
            for name, mod in modules.items():
                kernel_ms = time_ms(step_fn(mod.adamw_update, st, segments, lr, clip, step=3))
                row = {"bench": "adamw_ablation", "variant": name, "variant_desc": sources[name][0],
                       "case": fmt, "model": args.model, "numel": layout.numel, "kernel_ms": round(kernel_ms, 5),
                       "copy_ms": round(copy_ms, 5), "frac_of_copy": round(copy_ms / kernel_ms, 3), **env}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
            del st
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
