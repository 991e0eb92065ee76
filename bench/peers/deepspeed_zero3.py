"""Peer baseline: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned host memory, on one GPU.

    python -m bench.peers.deepspeed_zero3 --model qwen7b --micro-batch-size 2 --grad-accum 8 --out peers.jsonl

DeepSpeed is an optional extra (not on the benchmark machine's image; bench/peers/README.md says how to bring it):
when `import deepspeed` fails, the script writes a row with `"error": "deepspeed not installed"` and exits 0.

Before anything is built, a pre-flight check estimates the host memory the run needs (`host_estimate`: DeepSpeed's
own estimate of ZeRO-3 offload, 27 bytes a parameter) and, where that exceeds the host's RAM, writes a row whose
`error` names both figures and exits 0, instead of spending the build on a model that the kernel's OOM killer would
end (full-depth gpt-oss-20b: ~526 GiB against a 128 GiB host). Every row carries `host_estimate_gib` and
`host_ram_gib`.

The setup a transformers user gets from the HF integration: `HfDeepSpeedConfig(ds_config)` kept alive, then
`AutoModelForCausalLM.from_config(config)`, which builds the model under `deepspeed.zero.Init` (each parameter is
partitioned to pinned host memory as it is created, RoPE buffers kept fp32) and initialises the weights gathered
module by module; transformers picks the attention (SDPA; eager for gpt-oss, whose sinks SDPA lacks) and the MoE
expert kernels (grouped_mm where torch has it). ZeRO stage 3 with `offload_param` and `offload_optimizer` to the CPU
(`pin_memory: true`), bf16 (bf16 module weights on the GPU, fp32 master weights and Adam moments on the host),
`gradient_clipping: 1.0`, DeepSpeedCPUAdam in AdamW mode with the engine's decay split (its C++ op JIT-compiles at
first use, about a minute; the build time includes it), non-reentrant activation checkpointing through transformers.
Bucket sizes are what the HF Trainer's "auto" values resolve to: reduce_bucket_size = hidden^2,
stage3_prefetch_bucket_size = 0.9 hidden^2, stage3_param_persistence_threshold = 10 hidden. One process, one rank, no
launcher: the script sets MASTER_ADDR/PORT, RANK, WORLD_SIZE itself. `engine.backward` scales each micro-batch's loss
by 1/grad_accum and `engine.step()` steps at the accumulation boundary; `grad_norms` in the row are
`engine.get_global_grad_norm()`.

`--dry-run` (best effort, for checking the script where there is no GPU): a 2-layer truncated model on DeepSpeed's
CPU accelerator over gloo, fp32 (no bf16), offload devices still "cpu". It needs deepspeed and a C++ compiler for the
CPU Adam op.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, Dict, Optional, Tuple

import torch

from bench.peers import common
from engine.metrics import count_params

SYSTEM = "deepspeed_zero3_offload"
_KEEP: list = []

# Host bytes a parameter costs under ZeRO-3 with offload_param and offload_optimizer to the CPU and zero.Init, as
# DeepSpeed's own estimator counts them (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs): 18 =
# fp32 master weights 4 + Adam's two fp32 moments 8 + the fp32 gradient partition 4 + the bf16 weights 2, times its
# buffer factor 1.5 (pinned staging and bucket buffers). The measured qwen3b row (3.09B parameters,
# bench/results/peers_h200_*.jsonl) peaked at 74.4 GiB of host, under the 77.7 GiB this gives.
HOST_BYTES_PER_PARAM = 18 * 1.5


def host_estimate(fields) -> Tuple[Dict[str, Any], Optional[str]]:
    """(the row's host figures, the refusal's text or None): refused where the estimate exceeds the host's RAM."""
    import psutil

    params = count_params(common.model_config(fields))
    need_bytes = params * HOST_BYTES_PER_PARAM
    ram_bytes = psutil.virtual_memory().total
    figures = {"host_estimate_gib": need_bytes / common.GIB, "host_ram_gib": ram_bytes / common.GIB}
    if need_bytes <= ram_bytes:
        return figures, None
    return figures, (f"host memory: DeepSpeed ZeRO-3 offload needs ~{need_bytes / common.GIB:.0f} GiB of host for "
                     f"{params / 1e9:.2f}B parameters (DeepSpeed's estimate: 18 bytes a parameter x 1.5) and this "
                     f"host has {ram_bytes / common.GIB:.0f} GiB: not run")


def put_ninja_on_path() -> None:
    """torch's C++ extension build (the CPU Adam op's JIT) runs `ninja` from PATH; the ninja package keeps its
    executable next to the interpreter, which is not on PATH where python3 was called by its full path."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def ds_config(args, fields, bf16: bool) -> dict:
    h = fields["hidden_size"]
    return {
        "train_batch_size": args.micro_batch_size * args.grad_accum,
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": common.MAX_GRAD_NORM,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def init_gathered(model, deepspeed, std: float) -> None:
    """The HF init of these models (weights N(0, std), biases 0, norm weights 1), each module's partitioned
    parameters gathered in turn: under a bare zero.Init, transformers' own init saw only empty shards."""
    with torch.no_grad():
        for module in model.modules():
            params = list(module.named_parameters(recurse=False))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                for name, p in params:
                    if name.endswith("bias"):  # gpt-oss's expert biases are 2-D
                        p.zero_()
                    elif p.ndim >= 2:
                        p.normal_(0.0, std)
                    else:
                        p.fill_(1.0)


def build(args, fields, device, deepspeed):
    def _build(progress):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from transformers import AutoModelForCausalLM

        try:
            from transformers.integrations import HfDeepSpeedConfig
        except ImportError:  # older transformers
            from transformers.deepspeed import HfDeepSpeedConfig

        common.single_rank_env()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        progress("process group", f"deepspeed.init_distributed({backend}), 1 rank")
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        config = ds_config(args, fields, bf16=device.type == "cuda")
        cfg = common.hf_config(fields, args.attn_implementation)
        model_cls = common.hf_model_class(fields)  # imported outside zero.Init, which patches torch.Tensor.__new__
        try:  # the HF integration; its HfDeepSpeedConfig needs accelerate
            dschf = HfDeepSpeedConfig(config)
            _KEEP.append(dschf)  # must stay alive: transformers reads it through a weakref
            build_path = "HfDeepSpeedConfig + AutoModelForCausalLM.from_config (zero.Init)"
        except Exception as e:  # noqa: BLE001 - accelerate missing or too old
            dschf = None
            build_path = (f"deepspeed.zero.Init around the model constructor (HfDeepSpeedConfig failed: "
                          f"{type(e).__name__}: {str(e).strip()[:160]}); weights re-initialised N(0, "
                          f"{cfg.initializer_range}) module by module")
            print(f"[peer {SYSTEM}] NOTE: {build_path}", flush=True)
        progress("build", f"{build_path}; {type(cfg).__name__}, partitioned to pinned host memory")
        if dschf is not None:
            model = AutoModelForCausalLM.from_config(cfg)
        else:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = model_cls(cfg)
            init_gathered(model, deepspeed, cfg.initializer_range)
        common.enable_checkpointing(model)
        model.train()
        built_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        progress("optimizer", "DeepSpeedCPUAdam (its C++ op JIT-compiles at first use, about a minute)")
        put_ninja_on_path()
        t_adam = time.perf_counter()
        opt = DeepSpeedCPUAdam(common.param_groups(model), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                               weight_decay=common.WEIGHT_DECAY, adamw_mode=True)
        cpu_adam_build_s = time.perf_counter() - t_adam
        ga = args.grad_accum
        progress("deepspeed.initialize", "ZeRO-3, offload_param + offload_optimizer to pinned CPU")
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def step(batches, note=None):
            loss_sum = torch.zeros((), device=device)
            for j, ids in enumerate(batches):
                common.say(note, f"micro-batch {j + 1}/{ga} forward")
                loss = engine(input_ids=ids, labels=ids).loss
                common.say(note, f"micro-batch {j + 1}/{ga} backward")
                engine.backward(loss)
                common.say(note, f"micro-batch {j + 1}/{ga} engine.step" + (" (clip + host AdamW)" if j == ga - 1
                                                                            else ""))
                engine.step()
                loss_sum += loss.detach().float()
            gnorm = engine.get_global_grad_norm()
            return loss_sum / ga, float("nan") if gnorm is None else gnorm

        _KEEP.append(engine)
        return {"step": step, "built_params": built_params, "deepspeed": deepspeed.__version__,
                "optimizer": "DeepSpeedCPUAdam(adamw_mode=True)", "ds_config": config,
                "build_path": build_path, "cpu_adam_build_s": cpu_adam_build_s,
                **common.implementations(model),
                "activation_checkpointing": common.checkpointing_on(model),
                "mixed_precision": "bf16" if config["bf16"]["enabled"] else None}

    return _build


def import_deepspeed():
    """(module, None) or (None, error text for the row)."""
    try:
        import deepspeed

        return deepspeed, None
    except ModuleNotFoundError as e:
        if e.name == "deepspeed":
            return None, "deepspeed not installed"
        return None, f"deepspeed not installed: import failed ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a broken install is reported the same way
        return None, f"deepspeed not installed: import failed ({type(e).__name__}: {str(e)[:300]})"


def main() -> None:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="best-effort CPU smoke run on DeepSpeed's CPU accelerator (2 layers, 1 step, fp32)")
    args = ap.parse_args()
    common.finish_args(args, dry_run=args.dry_run)
    fields = common.model_fields(args)
    host, refusal = host_estimate(fields)
    if refusal:
        common.write_unrun_row(SYSTEM, args, fields, refusal, extra={"deepspeed": None, **host})
        print(f"[peer {SYSTEM}] {refusal}", flush=True)
        sys.exit(0)
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
    deepspeed, missing = import_deepspeed()
    if missing:
        common.write_unrun_row(SYSTEM, args, fields, missing, extra={"deepspeed": None, **host})
        print(f"[peer {SYSTEM}] {missing}: wrote an error row; bench/peers/README.md says how to bring it",
              flush=True)
        sys.exit(0)
    if not args.dry_run:
        common.refuse_without_cuda("deepspeed_zero3.py")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)

    def child() -> int:
        return common.run(SYSTEM, args, fields, build(args, fields, device, deepspeed), device,
                          extra={"dry_run": args.dry_run, "deepspeed": deepspeed.__version__, **host})

    common.main(SYSTEM, args, fields, child)


if __name__ == "__main__":
    main()
