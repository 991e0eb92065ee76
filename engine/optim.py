"""The optimizer recipe shared by both engines, and the host-side AdamW of the streaming engine.

Recipe: torch.optim.AdamW (fused kernel) on fp32 master weights; weight decay on matrices only;
global-norm clipping with the norm of the whole gradient; a step whose gradient norm is not finite is skipped and
leaves weights, moments and Adam's step counter untouched.

The gradient norm, one definition for both engines: `sq_norms` gives each tensor's sum of squares (every square
exact in fp64, summed in fp64, rounded to fp32), in the model's canonical parameter order; `global_norm` is the
square root of their fp64 sum, in fp32. A non-finite gradient element makes its tensor's sum, and so the global
norm, non-finite; so does a tensor norm above ~1.8e19, whose square overflows fp32. Both engines clip with
`clip_coefficient` of that norm and run the same fused AdamW kernel on tensors of the same shapes, so on one device
they produce bit-identical updates. The streaming engine runs that kernel per unit, over views into its flat buffers
(moments are views too, never torch allocations): on a worker thread for units whose state is in host RAM, on the
GPU's compute stream for the leading units whose state the plan put in GPU memory. Its fp32 gradients' sums of
squares come from the last micro-batch's accumulation (engine/streaming/gradients.py): on the CPU by `sq_norms`,
bit-identical to engine=reference; on a GPU from the fused accumulation kernel's registers (fp32 partials per
block, summed in fp64), equal to `sq_norms` to rounding only.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from engine.formats import update_seed
from streamtrain_kernels.adamw_update import adamw_update, layout_segments
from streamtrain_kernels.reference import dequantize_blocks_reference, sq_norms_reference

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing


def lr_at(step: int, t) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to lr * min_lr_ratio at the last step (0-indexed)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sq_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each gradient tensor's sum of squares (fp64, rounded to fp32), stacked, on the tensors' device."""
    return sq_norms_reference(grads).to(torch.float32)


def global_norm(sq: torch.Tensor) -> torch.Tensor:
    """The global L2 norm (fp32) from the per-tensor sums of squares of `sq_norms`, in canonical order."""
    return sq.double().sum().sqrt().to(torch.float32)


def clip_coefficient(total_norm: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Scale for the gradients, as torch.nn.utils.clip_grad_norm_ computes it (1 when clipping is off)."""
    if max_grad_norm <= 0:
        return torch.ones_like(total_norm)
    return torch.clamp(max_grad_norm / (total_norm + CLIP_EPS), max=1.0)


def make_adamw(decay: List[torch.Tensor], no_decay: List[torch.Tensor], t) -> torch.optim.AdamW:
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


class FlatAdamW:
    """AdamW over each unit's flat buffers (host or GPU memory), one fused torch.optim.AdamW per unit.

    Parameters are `nn.Parameter` views of the master buffer and Adam's state is pre-seeded with views of the m and
    v buffers, so the fused kernel updates the store in place. Gradients are handed over per call as a flat buffer
    of the unit's layout (a host-tier gradient or a staging buffer that held it). Every unit has its own step
    counter; a step skipped by the NaN guard is skipped for all units, so the counters stay equal.
    """

    def __init__(self, layouts, masters, ms, vs, t, units: Optional[Sequence[int]] = None):
        """`units`: the units this optimizer updates (default all); the others' buffers are not read (a sharded
        rank's placeholders: engine/distributed.py)."""
        self.layouts = layouts
        self.opts: List[Optional[torch.optim.AdamW]] = []
        self.params: List[List[torch.nn.Parameter]] = []
        mine = set(range(len(layouts)) if units is None else units)
        for index, (layout, master, m, v) in enumerate(zip(layouts, masters, ms, vs)):
            if index not in mine:
                self.opts.append(None)
                self.params.append([])
                continue
            pv, mv, vv = layout.views(master), layout.views(m), layout.views(v)
            decay, no_decay, ordered = [], [], []
            for spec in layout.specs:
                p = torch.nn.Parameter(pv[spec.name], requires_grad=False)
                ordered.append(p)
                (decay if spec.decay else no_decay).append(p)
            opt = make_adamw(decay, no_decay, t)
            for spec, p in zip(layout.specs, ordered):
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=master.device),
                                "exp_avg": mv[spec.name], "exp_avg_sq": vv[spec.name]}
            self.opts.append(opt)
            self.params.append(ordered)

    def step_unit(self, index: int, grad_flat: torch.Tensor, lr: float) -> None:
        for p, g in zip(self.params[index], self.layouts[index].views(grad_flat).values()):
            p.grad = g
        opt = self.opts[index]
        set_lr(opt, lr)
        opt.step()
        for p in self.params[index]:
            p.grad = None

    def bind_moments(self, index: int, m: torch.Tensor, v: torch.Tensor) -> None:
        """Point unit `index`'s Adam state at other flat m and v buffers (the NVMe tier's staging), keeping its
        step count."""
        layout = self.layouts[index]
        for p, mv, vv in zip(self.params[index], layout.views(m).values(), layout.views(v).values()):
            state = self.opts[index].state[p]
            state["exp_avg"], state["exp_avg_sq"] = mv, vv

    def step_count(self, index: int) -> float:
        return float(self.opts[index].state[self.params[index][0]]["step"])

    def set_step_count(self, index: int, step: float) -> None:
        for p in self.params[index]:
            self.opts[index].state[p]["step"].fill_(step)


STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def state_shapes(fmt, numel: int) -> Dict[str, Tuple[int, torch.dtype]]:
    """One unit's flat state in a format, name -> (numel, dtype): "master", "m", "v" and, for int8 moments, the fp32
    "m_scales" / "v_scales" (one per block of `fmt.block_size` elements of the flat unit)."""
    out = {"master": (numel, STATE_DTYPES[fmt.master])}
    if fmt.moments == "int8":
        n_blocks = fmt.n_blocks(numel)
        out.update(m=(numel, torch.int8), v=(numel, torch.uint8), m_scales=(n_blocks, torch.float32),
                   v_scales=(n_blocks, torch.float32))
    else:
        out.update(m=(numel, STATE_DTYPES[fmt.moments]), v=(numel, STATE_DTYPES[fmt.moments]))
    return out


def format_state_buffers(fmt, numel: int, device) -> Dict[str, torch.Tensor]:
    """Fresh state buffers of `state_shapes` on `device`: moments and scales zero, the master uninitialised."""
    return {name: (torch.empty if name == "master" else torch.zeros)(n, dtype=dtype, device=device)
            for name, (n, dtype) in state_shapes(fmt, numel).items()}


class FormatAdamW:
    """AdamW over units' flat state in a low-precision format (engine/formats.py), one fused launch per unit.

    Master, m and v are flat buffers of the unit's layout in the format's dtypes (int8 moments with fp32 per-block
    scales), made by `format_state_buffers`, wherever they live: GPU memory, or pinned host memory for a GPU-streamed
    unit, whose update then runs over GPU staging copies passed as `state` (engine/streaming/streamed_update.py).
    The update is `streamtrain_kernels.adamw_update` (on a CPU without the Triton interpreter, its torch reference: the
    same bits), reading the clip coefficient and the learning rate as device tensors. Adam's step count is kept per
    unit on the host; stochastic rounding is keyed by `formats.update_seed(seed, unit, step)`.
    """

    def __init__(self, layouts, fmt, t, seed: int, states: Sequence[Dict[str, torch.Tensor]], device):
        """`states`: each unit's buffers (`format_state_buffers`), the master already holding its weights.
        `device`: where the updates run (the learning-rate scalar lives there)."""
        self.layouts, self.fmt, self.t, self.seed = layouts, fmt, t, seed
        self.states = list(states)
        self.master = [st["master"] for st in states]
        self.m = [st["m"] for st in states]
        self.v = [st["v"] for st in states]
        quantized = fmt.moments == "int8"
        self.m_scales = [st["m_scales"] for st in states] if quantized else None
        self.v_scales = [st["v_scales"] for st in states] if quantized else None
        self.steps = [0] * len(states)
        self.segments = [layout_segments(lay, t.weight_decay) for lay in layouts]
        self.lr = torch.zeros((), dtype=torch.float32, device=device)

    @classmethod
    def from_masters(cls, layouts, fmt, t, seed: int, masters: Sequence[torch.Tensor]) -> "FormatAdamW":
        """State on the masters' device, the fp32 `masters` rounded to the master format to nearest."""
        states = []
        for w in masters:
            st = format_state_buffers(fmt, w.numel(), w.device)
            st["master"].copy_(w)
            states.append(st)
        return cls(layouts, fmt, t, seed, states, masters[0].device)

    def set_lr(self, lr: float) -> None:
        """The step's learning rate into the device scalar the kernel reads (a fill: no host-to-device copy)."""
        self.lr.fill_(lr)

    def step_unit(self, index: int, grad_flat: torch.Tensor, clip: torch.Tensor,
                  weights_out: Optional[torch.Tensor] = None,
                  state: Optional[Dict[str, torch.Tensor]] = None,
                  grad_scales: Optional[torch.Tensor] = None) -> None:
        """Update unit `index` in place: its own buffers, or `state` (the same names, e.g. GPU staging copies).
        `grad_scales`: an int8 gradient's per-block scales (`grad_flat` then holds its codes)."""
        st = self.states[index] if state is None else state
        self.steps[index] += 1
        scales = {}
        if self.m_scales is not None:
            scales = {"m_scales": st["m_scales"], "v_scales": st["v_scales"], "block_size": self.fmt.block_size}
        if grad_scales is not None:
            scales.update(grad_scales=grad_scales, grad_block_size=self.fmt.block_size)
        adamw_update(st["master"], st["m"], st["v"], grad_flat, lr=self.lr, clip=clip,
                     step=self.steps[index], beta1=self.t.beta1, beta2=self.t.beta2, eps=self.t.eps,
                     segments=self.segments[index], weights_out=weights_out,
                     seed=update_seed(self.seed, index, self.steps[index]), **scales)

    def unit_state(self, index: int) -> dict:
        """The unit's state for a checkpoint (views, not copies): master and fp32 / bf16 moments by tensor name in
        their formats; int8 moments flat with their scales (a block can span tensors), under "flat"."""
        layout = self.layouts[index]
        state = {"master": layout.views(self.master[index]), "exp_avg": {}, "exp_avg_sq": {}, "flat": {},
                 "step": float(self.steps[index])}
        if self.m_scales is not None:
            state["flat"] = {"exp_avg": self.m[index], "exp_avg_sq": self.v[index],
                             "exp_avg_scales": self.m_scales[index], "exp_avg_sq_scales": self.v_scales[index]}
        else:
            state["exp_avg"], state["exp_avg_sq"] = layout.views(self.m[index]), layout.views(self.v[index])
        return state

    def load_unit_state(self, index: int, master, exp_avg=None, exp_avg_sq=None, step: float = 0.0,
                        flat=None) -> None:
        """Copy a unit's state in (as `unit_state` gives it). A wider master (an HF import) rounds to nearest."""
        layout = self.layouts[index]
        for name, view in layout.views(self.master[index]).items():
            view.copy_(master[name])
        if flat:
            for buf, key in ((self.m[index], "exp_avg"), (self.v[index], "exp_avg_sq"),
                             (self.m_scales[index], "exp_avg_scales"), (self.v_scales[index], "exp_avg_sq_scales")):
                buf.copy_(flat[key])
        elif exp_avg is not None:
            for moments, values in ((self.m[index], exp_avg), (self.v[index], exp_avg_sq)):
                for name, view in layout.views(moments).items():
                    view.copy_(values[name])
        if flat or exp_avg is not None:
            self.steps[index] = int(step)

    def moments_by_name(self, index: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """fp32 copies on the CPU of the unit's m and v by tensor name (int8 ones dequantized with their scales)."""
        m, v = self.m[index], self.v[index]
        if self.m_scales is not None:
            m = dequantize_blocks_reference(m, self.m_scales[index], self.fmt.block_size, signed=True)
            v = dequantize_blocks_reference(v, self.v_scales[index], self.fmt.block_size, signed=False)
        layout = self.layouts[index]
        m_views, v_views = layout.views(m), layout.views(v)
        return {layout.prefix + name: (m_views[name].to("cpu", torch.float32, copy=True),
                                       v_views[name].to("cpu", torch.float32, copy=True)) for name in m_views}

    def nbytes(self, units: Optional[Sequence[int]] = None) -> Dict[str, int]:
        """Bytes of the state of `units` (default all): the master, and the moments with their scales."""
        units = range(len(self.states)) if units is None else units
        size = lambda u, names: sum(self.states[u][k].numel() * self.states[u][k].element_size()  # noqa: E731
                                    for k in names if k in self.states[u])
        return {"master": sum(size(u, ["master"]) for u in units),
                "moments": sum(size(u, ["m", "v", "m_scales", "v_scales"]) for u in units)}
