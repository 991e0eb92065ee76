"""Peer baseline: PyTorch FSDP2 with CPU offload on one GPU (parameters, gradients and AdamW state in host RAM).

    python -m bench.peers.fsdp2_offload --model qwen7b --micro-batch-size 2 --grad-accum 8 --out peers.jsonl

`fully_shard` on every decoder layer and on the root, each with `CPUOffloadPolicy(pin_memory=True)` and
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, over a 1-rank process group that the script
initialises itself (MASTER_ADDR/PORT, RANK, WORLD_SIZE set here: no torchrun). The backend is
"cuda:nccl,cpu:gloo", as torchtitan uses with CPU offload: the gradient-norm reduction runs on the host-resident
(DTensor) gradients, which NCCL cannot reduce. FSDP2's mixed-precision policy is the bf16 compute (no autocast on
top, as torchtitan does). Non-reentrant activation checkpointing of every decoder layer, loss / grad_accum per
micro-batch; `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` on the DTensor gradients (FSDP2 modules have
no `clip_grad_norm_` method of their own; this is the call its docs and torchtitan use), then torch.optim.AdamW on
the host: `fused=True` when one probe step of the fused CPU kernel on one of the model's sharded parameters works,
else `foreach=True` with a printed note (the row's `optimizer` says which).

`--grad-sync every` (default, what fully_shard does untouched): every micro-batch's backward reduce-scatters and
offloads its gradients, accumulated on the host. `--grad-sync last`: `set_requires_gradient_sync(False)` on all but
the last micro-batch, so gradients accumulate unsharded on the GPU (fp32) and move to the host once per step.
`--build-on gpu` (default with CUDA) initialises the fp32 model on the GPU, then fully_shard moves each shard to
pinned host memory; `--build-on cpu` initialises it in host RAM, as a script that builds the model before sharding
it does (slower, and one more fp32 copy of the model in host RAM while building).

`--dry-run` runs a 2-layer truncated model on the CPU over gloo (FSDP2 on a CPU mesh, offload policy unpinned): a
smoke test of the script only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.peers import common

SYSTEM = "fsdp2_cpu_offload"

try:  # torch >= 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def make_optimizer(model, progress):
    """Fused AdamW on the host-resident DTensor parameters if one probe step of it works there, else foreach."""
    groups = common.param_groups(model)
    kw = dict(lr=common.LR, betas=common.BETAS, eps=common.EPS, weight_decay=common.WEIGHT_DECAY)
    probe = groups[-1]["params"][0]  # a norm weight or bias: small
    try:
        saved = probe.detach().clone()
        probe.grad = torch.zeros_like(probe)
        torch.optim.AdamW([probe], lr=0.0, weight_decay=0.0, fused=True).step()
        with torch.no_grad():
            probe.copy_(saved)
        probe.grad = None
        return torch.optim.AdamW(groups, fused=True, **kw), "torch.optim.AdamW(fused=True) on CPU"
    except Exception as e:  # noqa: BLE001 - any failure of the probe means: not supported here
        probe.grad = None
        note = f"fused CPU AdamW unavailable for these parameters ({type(e).__name__}: {str(e)[:200]}); using foreach"
        print(f"[peer {SYSTEM}] NOTE: {note}", flush=True)
        progress("optimizer", note)
        return torch.optim.AdamW(groups, foreach=True, **kw), "torch.optim.AdamW(foreach=True) on CPU"


def build(args, fields, device):
    def _build(progress):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        common.single_rank_env()
        if device.type == "cuda":
            torch.cuda.set_device(device)
            backend = "cuda:nccl,cpu:gloo"
        else:
            backend = "gloo"
        progress("process group", f"{backend}, 1 rank, {common.os.environ['MASTER_ADDR']}:"
                                  f"{common.os.environ['MASTER_PORT']}")
        dist.init_process_group(backend=backend, rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        cfg = common.hf_config(fields, args.attn_implementation)
        build_device = torch.device("cpu") if args.build_on == "cpu" else device
        progress("build", f"{common.hf_model_class(fields).__name__}, fp32, initialised on {build_device}")
        with torch.device(build_device):
            model = common.hf_model_class(fields)(cfg)
        model.to(dtype=torch.float32)
        common.enable_checkpointing(model)
        model.train()
        built_params = sum(p.numel() for p in model.parameters())
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        layers = model.model.layers
        for i, layer in enumerate(layers):
            if i % 4 == 0:
                progress("shard", f"fully_shard decoder layers {i}..{min(i + 3, len(layers) - 1)}")
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        progress("shard", "fully_shard root (embeddings, final norm, LM head)")
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress("optimizer", "AdamW on host-resident parameters")
        opt, opt_name = make_optimizer(model, progress)
        ga = args.grad_accum

        def step(batches, note=None):
            loss_sum = torch.zeros((), device=device)
            for j, ids in enumerate(batches):
                if args.grad_sync == "last":
                    model.set_requires_gradient_sync(j == ga - 1)
                common.say(note, f"micro-batch {j + 1}/{ga} forward")
                loss = model(input_ids=ids, labels=ids).loss
                common.say(note, f"micro-batch {j + 1}/{ga} backward")
                (loss / ga).backward()
                loss_sum += loss.detach()
            common.say(note, "clip (host gradients)")
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), common.MAX_GRAD_NORM)
            if isinstance(gnorm, DTensor):
                gnorm = gnorm.full_tensor()
            common.say(note, "optimizer (host AdamW)")
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss_sum / ga, gnorm

        first = next(model.parameters())
        return {"step": step, "built_params": built_params, "optimizer": opt_name, "grad_sync": args.grad_sync,
                "build_on": build_device.type, "backend": backend, "param_device": first.device.type,
                "param_pinned": bool(first.to_local().is_pinned()) if isinstance(first, DTensor) else None,
                **common.implementations(model),
                "activation_checkpointing": common.checkpointing_on(model),
                "mixed_precision": "param bf16, reduce fp32"}

    return _build


def main() -> None:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--grad-sync", choices=("every", "last"), default="every",
                    help="reduce-scatter + offload gradients after every micro-batch (default) or the last only")
    ap.add_argument("--build-on", choices=("gpu", "cpu"), default="gpu",
                    help="where the fp32 model is initialised before fully_shard moves it to pinned host memory")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke run over gloo: 2 layers, 1 step")
    args = ap.parse_args()
    common.finish_args(args, dry_run=args.dry_run)
    fields = common.model_fields(args)
    if not args.dry_run:
        common.refuse_without_cuda("fsdp2_offload.py")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)

    def child() -> int:
        try:
            return common.run(SYSTEM, args, fields, build(args, fields, device), device,
                              extra={"dry_run": args.dry_run})
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    common.main(SYSTEM, args, fields, child)


if __name__ == "__main__":
    main()
