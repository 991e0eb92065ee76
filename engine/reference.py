"""The reference engine: the whole model, its gradients and AdamW state on one device.

This is the plain-PyTorch oracle the streaming engine is proven against, and the "all state on the GPU" baseline:
every parameter is its own fp32 `nn.Parameter` (16 B/param with gradient and moments), the forward runs under bf16
autocast on CUDA (fp32 on CPU), each decoder layer is activation-checkpointed, micro-batch gradients accumulate in
`.grad`, then global-norm clipping and torch.optim.AdamW(fused=True). It uses the same layer templates, init, norm
and clipping helpers as the streaming engine, so the two differ only in where state lives and when work happens: the
gradient norm is `optim.global_norm` of `optim.sq_norms` (per-tensor sums of squares in fp64) over the finished
`.grad` tensors in canonical order, which the streaming engine gets from its last accumulation instead.

With a low-precision state format (engine/formats.py) it is the plain-PyTorch run of that format: each unit's
parameters are views of one fp32 flat buffer holding the master's values, the unit's master and moments live in the
format (`optim.FormatAdamW`), and after each update the fresh master is upcast into the flat buffer (exact: bf16
values are fp32 values). Per unit and step: one gather of the gradients into a flat fp32 buffer, one fused update,
one upcast; with bf16 gradients, one stochastic rounding of the gathered gradient before the norm.
`train.fp32_update=kernel` runs fp32 state through that same path: the fused kernel in place of torch's AdamW, to
tell the update path's effect on training from the formats' own (unit states, and so checkpoints, are the same).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from engine import optim
from engine.distributed import SINGLE, DataParallel
from engine.device import autocast_ctx
from engine.formats import GRAD_STREAM, StateFormat, update_seed
from streamtrain_kernels.grad_accum import to_bf16_stochastic
from streamtrain_kernels.grad_quant import quantize_grad_int8
from engine.model import ModelSpec
from engine.model.rope import Positions
from engine.batch import Batch, loss_tokens


class ReferenceEngine:
    name = "reference"

    def __init__(self, spec: ModelSpec, cfg, device: torch.device, compute_dtype: torch.dtype,
                 dp: DataParallel = SINGLE):
        self.spec, self.t, self.device, self.compute_dtype, self.dp = spec, cfg.train, device, compute_dtype, dp
        self.fmt = StateFormat.of(cfg.train)
        # fp32 state updated by torch's fused AdamW (the exact recipe), or else by the fused update kernel through
        # FormatAdamW over flat buffers (low-precision formats; fp32 too with train.fp32_update=kernel)
        self.torch_adamw = self.fmt.torch_adamw(cfg.train.fp32_update)
        self.params: List[Dict[str, torch.nn.Parameter]] = []
        decay, no_decay = [], []
        self.flat: List[torch.Tensor] = []  # low-precision formats: each unit's weights, fp32, one buffer
        for unit in spec.units:
            if self.torch_adamw:
                host = {s.name: torch.empty(s.shape, dtype=torch.float32) for s in unit.layout.specs}
                spec.init_unit(unit, host, cfg.seed)
                params = {name: torch.nn.Parameter(t.to(device)) for name, t in host.items()}
            else:
                host_flat = torch.zeros(unit.layout.numel, dtype=torch.float32)
                spec.init_unit(unit, unit.layout.views(host_flat), cfg.seed)
                self.flat.append(host_flat.to(device))
                params = {name: torch.nn.Parameter(view) for name, view in unit.layout.views(self.flat[-1]).items()}
            for s in unit.layout.specs:
                (decay if s.decay else no_decay).append(params[s.name])
            self.params.append(params)
        self.ordered = [p for unit in self.params for p in unit.values()]
        if self.torch_adamw:
            self.opt = optim.make_adamw(decay, no_decay, self.t)
        else:
            self.opt = optim.FormatAdamW.from_masters([u.layout for u in spec.units], self.fmt, self.t, cfg.seed,
                                                       self.flat)
            for flat, master in zip(self.flat, self.opt.master):
                flat.copy_(master)  # the model computes with the master's values
            self.grad_flat = [torch.zeros_like(f) for f in self.flat]
            held_dtype = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}[self.fmt.grad]
            self.grad_held = self.grad_flat if held_dtype is None else \
                [torch.zeros_like(f, dtype=held_dtype) for f in self.flat]
            # int8 gradients: each unit's per-block scales beside its codes
            self.grad_scales = [torch.zeros(self.fmt.n_blocks(f.numel()), dtype=torch.float32, device=device)
                                for f in self.flat] if self.fmt.grad == "int8" else None
        self.tables: Optional[Positions] = None
        self.skipped_steps = 0

    def _positions(self, b: Batch) -> Positions:
        T = b.ids_BT.shape[1]
        if self.tables is None or self.tables.table_len != T:
            self.tables = self.spec.positions(T, self.device)
        return self.tables.of_rows(b.doc_start_BT)

    def _loss_sum(self, b: Batch) -> torch.Tensor:
        spec = self.spec
        pos = self._positions(b)
        embed_p, head_p = self.params[0], self.params[-1]
        with autocast_ctx(self.device, self.compute_dtype):
            x = spec.embed(embed_p, b.ids_BT)
            for unit in spec.layer_units:
                p = self.params[unit.index]
                if self.t.activation_checkpointing and torch.is_grad_enabled():
                    x = checkpoint(spec.layer, p, x, pos, unit.layer, use_reentrant=False, preserve_rng_state=False)
                else:
                    x = spec.layer(p, x, pos, unit.layer)
            tied = embed_p[spec.tied_weight_name] if spec.tied else None
            return spec.loss_sum(head_p, x, b.labels_BT, tied)

    def train_step(self, batches: Sequence[Batch], lr: float, grad_hook=None) -> dict:
        """One optimizer step over the micro-batches. `grad_hook(unit_index, {name: grad})` (tests only) may edit
        each unit's gradient before the norm is taken."""
        t0 = time.perf_counter()
        step_tokens = sum(b.tokens for b in batches) * self.dp.world  # every rank runs the same shapes
        self.spec.begin_step(step_tokens)
        n_tokens = loss_tokens(batches, self.dp)
        loss_total = torch.zeros((), device=self.device)
        for b in batches:
            loss = self._loss_sum(b.to(self.device, non_blocking=True)) / n_tokens
            loss.backward()
            loss_total += loss.detach()
        if self.dp.active:  # data parallel: the gradients and the loss summed over ranks (engine/distributed.py)
            for params in self.params:  # one collective per unit
                for p in params.values():
                    if p.grad is None:  # a tensor this rank's micro-batches did not reach: every rank sends one
                        p.grad = torch.zeros_like(p)
                self.dp.all_reduce_tensors_([p.grad for p in params.values()])
            self.dp.all_reduce_(loss_total)
        if grad_hook is not None:
            for unit, params in zip(self.spec.units, self.params):
                grad_hook(unit.index, {name: p.grad for name, p in params.items()})
        grads = [p.grad for p in self.ordered] if self.torch_adamw else self._held_grads()
        total_norm = optim.global_norm(optim.sq_norms(grads))
        skipped = not bool(torch.isfinite(total_norm))
        if skipped:
            self.skipped_steps += 1
        elif self.torch_adamw:
            coef = optim.clip_coefficient(total_norm, self.t.max_grad_norm)
            torch._foreach_mul_(grads, coef)
            optim.set_lr(self.opt, lr)
            self.opt.step()
        else:
            self._format_step(optim.clip_coefficient(total_norm, self.t.max_grad_norm), lr)
        for p in self.ordered:
            p.grad = None  # frees 4 B/param between steps (validation runs there)
        loss_value = float(loss_total)
        return {"loss": loss_value, "grad_norm": float(total_norm), "skipped": skipped,
                "skipped_steps": self.skipped_steps, "tokens": step_tokens, "loss_tokens": n_tokens,
                "step_s": time.perf_counter() - t0}

    @torch.no_grad()
    def _held_grads(self) -> List[torch.Tensor]:
        """Low-precision formats: each unit's gradient gathered into its flat buffer and held in the gradient
        format (bf16 or int8: stochastically rounded, keyed by the step that will read it); per-tensor views of the
        held values (int8: dequantized over the gathered gradient), in the canonical order, for the norm."""
        views = []
        for unit, params in zip(self.spec.units, self.params):
            u = unit.index
            flat_views = unit.layout.views(self.grad_flat[u])
            for name, p in params.items():
                flat_views[name].copy_(p.grad)
            seed = update_seed(self.opt.seed, u, self.opt.steps[u] + 1) ^ GRAD_STREAM
            held = self.grad_held[u]
            if self.fmt.grad == "bf16":
                to_bf16_stochastic(self.grad_flat[u], held, seed)
            elif self.fmt.grad == "int8":
                quantize_grad_int8(self.grad_flat[u], held, self.grad_scales[u], seed, self.fmt.block_size,
                                   dequantized_out=self.grad_flat[u])
                held = self.grad_flat[u]
            views += list(unit.layout.views(held).values())
        return views

    @torch.no_grad()
    def _format_step(self, coef: torch.Tensor, lr: float) -> None:
        self.opt.set_lr(lr)
        for unit in self.spec.units:
            self.opt.step_unit(unit.index, self.grad_held[unit.index], coef,
                               grad_scales=self.grad_scales[unit.index] if self.grad_scales else None)
            self.flat[unit.index].copy_(self.opt.master[unit.index])

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[Batch]) -> float:
        total = 0.0
        for b in batches:
            total += float(self._loss_sum(b.to(self.device)))
        return total / loss_tokens(batches)

    def master_weights(self) -> Dict[str, torch.Tensor]:
        """fp32 weights by HF name (copies on the CPU)."""
        return {u.layout.prefix + name: p.detach().to("cpu", copy=True)
                for u, ps in zip(self.spec.units, self.params) for name, p in ps.items()}

    def adam_moments(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        if not self.torch_adamw:
            return {k: mv for u in self.spec.units for k, mv in self.opt.moments_by_name(u.index).items()}
        out = {}
        for u, ps in zip(self.spec.units, self.params):
            for name, p in ps.items():
                st = self.opt.state.get(p, {})
                if st:
                    out[u.layout.prefix + name] = tuple(st[k].to("cpu", copy=True) for k in ("exp_avg", "exp_avg_sq"))
        return out

    def unit_state(self, index: int) -> dict:
        """One unit's training state by name (live tensors on the engine's device, not copies): fp32 master
        weights, Adam moments (empty before the first update) and Adam's step count."""
        if not self.torch_adamw:
            return self.opt.unit_state(index)
        params = self.params[index]
        state = {"master": {n: p.detach() for n, p in params.items()}, "exp_avg": {}, "exp_avg_sq": {}, "step": 0.0}
        for name, p in params.items():
            st = self.opt.state.get(p)
            if st:
                state["exp_avg"][name], state["exp_avg_sq"][name] = st["exp_avg"], st["exp_avg_sq"]
                state["step"] = float(st["step"])
        return state

    @torch.no_grad()
    def load_unit_state(self, index: int, master: Dict[str, torch.Tensor], exp_avg=None, exp_avg_sq=None,
                        step: float = 0.0, flat=None) -> None:
        """Copy a unit's state in (names and shapes as in `unit_state`); moments are optional (HF import)."""
        if not self.torch_adamw:
            self.opt.load_unit_state(index, master, exp_avg, exp_avg_sq, step, flat)
            self.flat[index].copy_(self.opt.master[index])
            return
        for name, p in self.params[index].items():
            p.copy_(master[name])
            if exp_avg is not None:
                self.opt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=p.device),
                                     "exp_avg": exp_avg[name].to(p.device, torch.float32).clone(),
                                     "exp_avg_sq": exp_avg_sq[name].to(p.device, torch.float32).clone()}

    def memory_bytes(self) -> Dict[str, int]:
        n = sum(p.numel() for p in self.ordered)
        tier = "gpu" if self.device.type == "cuda" else "host"
        if self.torch_adamw:
            return {f"{tier}_master": 4 * n, f"{tier}_grads": 4 * n, f"{tier}_moments": 8 * n}
        state = self.opt.nbytes()
        return {f"{tier}_master": state["master"], f"{tier}_weights_fp32": 4 * n, f"{tier}_grads": 8 * n,
                f"{tier}_moments": state["moments"]}

    def wait_for_optimizer(self) -> None:
        """Nothing to wait for: the update runs inside `train_step`."""

    def close(self) -> None:
        pass
