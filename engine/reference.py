"""The reference engine: the whole model, its gradients and AdamW state on one device.

This is the plain-PyTorch oracle the streaming engine is proven against, and the "all state on the GPU" baseline:
every parameter is its own fp32 `nn.Parameter` (16 B/param with gradient and moments), the forward runs under bf16
autocast on CUDA (fp32 on CPU), each decoder layer is activation-checkpointed, micro-batch gradients accumulate in
`.grad`, then global-norm clipping and torch.optim.AdamW(fused=True). It uses the same layer templates, init, norm
and clipping helpers as the streaming engine, so the two differ only in where state lives and when work happens.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from engine import optim
from engine.device import autocast_ctx
from engine.model import ModelSpec

Batch = Tuple[torch.Tensor, torch.Tensor]


class ReferenceEngine:
    name = "reference"

    def __init__(self, spec: ModelSpec, cfg, device: torch.device, compute_dtype: torch.dtype):
        self.spec, self.t, self.device, self.compute_dtype = spec, cfg.train, device, compute_dtype
        self.params: List[Dict[str, torch.nn.Parameter]] = []
        decay, no_decay = [], []
        for unit in spec.units:
            host = {s.name: torch.empty(s.shape, dtype=torch.float32) for s in unit.layout.specs}
            spec.init_unit(unit, host, cfg.seed)
            params = {}
            for s in unit.layout.specs:
                p = torch.nn.Parameter(host[s.name].to(device))
                params[s.name] = p
                (decay if s.decay else no_decay).append(p)
            self.params.append(params)
        self.ordered = [p for unit in self.params for p in unit.values()]
        self.opt = optim.make_adamw(decay, no_decay, self.t)
        self.rope = None
        self.skipped_steps = 0

    def _rope(self, seq_len: int):
        if self.rope is None or self.rope.cos_TD.shape[0] != seq_len:
            self.rope = self.spec.rope(seq_len, self.device)
        return self.rope

    def _loss_sum(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        rope = self._rope(ids_BT.shape[1])
        embed_p, head_p = self.params[0], self.params[-1]
        with autocast_ctx(self.device, self.compute_dtype):
            x = spec.embed(embed_p, ids_BT)
            for unit in spec.layer_units:
                p = self.params[unit.index]
                if self.t.activation_checkpointing and torch.is_grad_enabled():
                    x = checkpoint(spec.layer, p, x, rope, use_reentrant=False, preserve_rng_state=False)
                else:
                    x = spec.layer(p, x, rope)
            tied = embed_p[spec.tied_weight_name] if spec.tied else None
            return spec.loss_sum(head_p, x, labels_BT, tied)

    def train_step(self, batches: Sequence[Batch], lr: float, grad_hook=None) -> dict:
        """One optimizer step over the micro-batches. `grad_hook(unit_index, {name: grad})` (tests only) may edit
        each unit's gradient before the norm is taken."""
        t0 = time.perf_counter()
        n_tokens = sum(labels.numel() for _, labels in batches)
        loss_total = torch.zeros((), device=self.device)
        for ids, labels in batches:
            ids, labels = ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            loss = self._loss_sum(ids, labels) / n_tokens
            loss.backward()
            loss_total += loss.detach()
        if grad_hook is not None:
            for unit, params in zip(self.spec.units, self.params):
                grad_hook(unit.index, {name: p.grad for name, p in params.items()})
        grads = [p.grad for p in self.ordered]
        total_norm = optim.global_norm(optim.tensor_norms(grads))
        skipped = not bool(torch.isfinite(total_norm))
        if skipped:
            self.skipped_steps += 1
        else:
            coef = optim.clip_coefficient(total_norm, self.t.max_grad_norm)
            torch._foreach_mul_(grads, coef)
            optim.set_lr(self.opt, lr)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # frees 4 B/param between steps (validation runs there)
        loss_value = float(loss_total)
        return {"loss": loss_value, "grad_norm": float(total_norm), "skipped": skipped,
                "skipped_steps": self.skipped_steps, "tokens": n_tokens, "step_s": time.perf_counter() - t0}

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[Batch]) -> float:
        total, n = 0.0, 0
        for ids, labels in batches:
            ids, labels = ids.to(self.device), labels.to(self.device)
            total += float(self._loss_sum(ids, labels))
            n += labels.numel()
        return total / n

    def master_weights(self) -> Dict[str, torch.Tensor]:
        """fp32 weights by HF name (copies on the CPU)."""
        return {u.layout.prefix + name: p.detach().to("cpu", copy=True)
                for u, ps in zip(self.spec.units, self.params) for name, p in ps.items()}

    def adam_moments(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
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
                        step: float = 0.0) -> None:
        """Copy a unit's state in (names and shapes as in `unit_state`); moments are optional (HF import)."""
        for name, p in self.params[index].items():
            p.copy_(master[name])
            if exp_avg is not None:
                self.opt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=p.device),
                                     "exp_avg": exp_avg[name].to(p.device, torch.float32).clone(),
                                     "exp_avg_sq": exp_avg_sq[name].to(p.device, torch.float32).clone()}

    def memory_bytes(self) -> Dict[str, int]:
        n = sum(p.numel() for p in self.ordered)
        tier = "gpu" if self.device.type == "cuda" else "host"
        return {f"{tier}_master": 4 * n, f"{tier}_grads": 4 * n, f"{tier}_moments": 8 * n}

    def close(self) -> None:
        pass
