"""Peer baseline "all state on the GPU": the whole transformers model, its gradients and AdamW state on one GPU.

    python -m bench.peers.all_on_gpu --model qwen7b --micro-batch-size 2 --grad-accum 8 --out bench/results/peers.jsonl

fp32 parameters built directly on the GPU (random init), torch.autocast(bfloat16) around each micro-batch's forward,
non-reentrant activation checkpointing of every decoder layer, loss / grad_accum per micro-batch, then
torch.nn.utils.clip_grad_norm_(1.0) and torch.optim.AdamW(fused=True) on the GPU; gradients are freed after each
step (zero_grad(set_to_none=True)). This is what a user who has the GPU memory runs; at qwen7b on an H200 only
micro-batch 2 fits.

`--dry-run` builds a 2-layer truncated model on the CPU and runs one step in fp32 without autocast: a smoke test of
the script, not a measurement. Details shared by all peers (rows, timing, the supervisor): bench/peers/common.py.
"""

from __future__ import annotations

import torch

from bench.peers import common

SYSTEM = "all_on_gpu"


def build(args, fields, device, use_autocast: bool):
    def _build(progress):
        cfg = common.hf_config(fields, args.attn_implementation)
        progress("build", f"{type(cfg).__name__} -> {common.hf_model_class(fields).__name__} on {device}, fp32")
        with torch.device(device):
            model = common.hf_model_class(fields)(cfg)
        model.to(device=device, dtype=torch.float32)
        common.enable_checkpointing(model)
        model.train()
        built_params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(common.param_groups(model), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                                weight_decay=common.WEIGHT_DECAY, fused=True)
        params = [p for p in model.parameters() if p.requires_grad]
        ga = args.grad_accum

        def step(batches, note=None):
            loss_sum = torch.zeros((), device=device)
            for j, ids in enumerate(batches):
                common.say(note, f"micro-batch {j + 1}/{ga} forward")
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_autocast):
                    loss = model(input_ids=ids, labels=ids).loss
                common.say(note, f"micro-batch {j + 1}/{ga} backward")
                (loss / ga).backward()
                loss_sum += loss.detach()
            common.say(note, "clip + optimizer")
            gnorm = torch.nn.utils.clip_grad_norm_(params, common.MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss_sum / ga, gnorm

        return {"step": step, "built_params": built_params, **common.implementations(model),
                "activation_checkpointing": common.checkpointing_on(model),
                "optimizer": "torch.optim.AdamW(fused=True)", "autocast": "bf16" if use_autocast else None}

    return _build


def main() -> None:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke run: 2 layers, 1 step, fp32, no autocast")
    args = ap.parse_args()
    common.finish_args(args, dry_run=args.dry_run)
    fields = common.model_fields(args)
    if not args.dry_run:
        common.refuse_without_cuda("all_on_gpu.py")
    # no CUDA call here (current_device() would create a context): the supervising parent must hold no GPU memory
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)

    def child() -> int:
        return common.run(SYSTEM, args, fields, build(args, fields, device, use_autocast=not args.dry_run), device,
                          extra={"dry_run": args.dry_run})

    common.main(SYSTEM, args, fields, child)


if __name__ == "__main__":
    main()
