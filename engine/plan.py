"""Memory plan: how many bytes of which state live in which tier, decided before anything large is allocated.

For `engine=reference` everything sits on the compute device: fp32 master, gradient and two moments (16 B/param),
plus one checkpoint per layer per micro-batch and one layer's working activations.

For `engine=stream` the host holds fp32 master, m and v (12 B/param) in one pinned arena. The GPU holds the fixed
working set: a ring of `engine.slots` layer slots (fp32 staging + compute-dtype copy of the cast segment), the
embedding/head units while they are in use, the activations of one layer for one micro-batch, and the running
residual-gradient of every micro-batch. What is left of the GPU's budget is spent in this order of benefit
(DESIGN.md §4): layer-input checkpoints (else they go to pinned host memory), full gradients waiting for the global
norm when the host could not hold them, every layer's compute-dtype weights from forward to backward (saves the
backward's H2D), then gradients anyway (saves 4 B/param of host RAM). An `engine.*_tier` set to gpu or host
overrides `auto`; a plan that does not fit raises PlanError with the numbers.

Activation working-set figures are estimates (bytes per token per layer, from the tensors autograd keeps in
`decoder_layer`); `gpu_margin_gib` covers the allocator's fragmentation and the CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

GIB = 2**30


class PlanError(RuntimeError):
    pass


@dataclass
class MemoryPlan:
    engine: str
    rows: List[Tuple[str, str, int]] = field(default_factory=list)  # (tier, item, bytes)
    placement: Dict[str, str] = field(default_factory=dict)
    limits_gib: Dict[str, float] = field(default_factory=dict)

    def add(self, tier: str, item: str, nbytes: int) -> None:
        self.rows.append((tier, item, int(nbytes)))

    def total(self, tier: str) -> int:
        return sum(b for t, _, b in self.rows if t == tier)

    def problem(self) -> str:
        """Why the plan does not fit, or "" when it does."""
        for tier, limit in self.limits_gib.items():
            if limit and self.total(tier) > limit * GIB:
                alternatives = "a smaller model or other hardware"
                if self.engine == "reference":
                    alternatives += ", or engine=stream (state in host RAM)"
                return (f"The plan needs {self.total(tier) / GIB:.1f} GiB of {tier} memory but the hardware config "
                        f"allows {limit:.1f} GiB. Try fewer tokens per step (train.micro_batch_size, "
                        f"train.grad_accum, train.seq_len), {alternatives}.")
        return ""

    def table(self) -> str:
        lines = [f"memory plan (engine={self.engine})", f"{'tier':6} {'item':56} {'GiB':>10}"]
        for tier, item, nbytes in self.rows:
            lines.append(f"{tier:6} {item:56} {nbytes / GIB:10.3f}")
        for tier in ("gpu", "host"):
            limit = self.limits_gib.get(tier)
            lim = f" of {limit:.1f} GiB" if limit else ""
            lines.append(f"{tier:6} {'TOTAL':56} {self.total(tier) / GIB:10.3f}{lim}")
        if self.placement:
            lines.append("placement: " + ", ".join(f"{k}={v}" for k, v in self.placement.items()))
        return "\n".join(lines)


def layer_activation_bytes_per_token(spec, compute_bytes: int) -> int:
    """Bytes autograd keeps per token while one decoder layer runs backward (recomputed forward)."""
    a = spec.arch
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    fp32 = 4
    kept = (fp32 * a.hidden * 3  # residual in, norm outputs (fp32)
            + compute_bytes * (q + 2 * kv) + fp32 * (q + kv)  # projections, roped q/k
            + compute_bytes * (q + a.hidden)  # attention output, o_proj output
            + compute_bytes * a.intermediate * 4)  # gate, up, silu(gate), product
    return int(kept * 1.5)  # gradients of the same tensors exist transiently during backward


def loss_activation_bytes(spec, tokens: int) -> int:
    from engine.model.dense import LOSS_CHUNK_ELEMS

    chunk = min(tokens, max(1, LOSS_CHUNK_ELEMS // spec.arch.vocab))
    return chunk * spec.arch.vocab * (2 + 4 + 4)  # bf16 logits, fp32 upcast, its gradient


def build_plan(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, check: bool = True) -> MemoryPlan:
    plan = _build(spec, cfg, gpu_gib, host_gib, on_gpu)
    if check and plan.problem():
        raise PlanError(f"{plan.table()}\n\n{plan.problem()}")
    return plan


def _build(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool) -> MemoryPlan:
    t, e = cfg.train, cfg.engine
    n = spec.num_params()
    compute_bytes = 2 if on_gpu and t.compute_dtype != "fp32" else 4
    mb_tokens = t.micro_batch_size * t.seq_len
    step_tokens = mb_tokens * t.grad_accum
    h = spec.arch.hidden
    L = spec.num_layers
    act = layer_activation_bytes_per_token(spec, compute_bytes) * mb_tokens + loss_activation_bytes(spec, mb_tokens)
    compute_tier = "gpu" if on_gpu else "host"
    plan = MemoryPlan(engine=cfg.engine.name, limits_gib={"gpu": gpu_gib if on_gpu else 0.0, "host": host_gib})
    if cfg.engine.name == "reference":
        plan.add(compute_tier, "fp32 master weights", 4 * n)
        plan.add(compute_tier, "fp32 gradients", 4 * n)
        plan.add(compute_tier, "fp32 Adam m + v", 8 * n)
        ckpt = (L if t.activation_checkpointing else 0) * 4 * h * mb_tokens
        plan.add(compute_tier, "layer-input checkpoints (one micro-batch)", ckpt)
        plan.add(compute_tier, "working activations (one layer + loss chunk)",
                 act * (1 if t.activation_checkpointing else L))
        return plan

    layouts = [u.layout for u in spec.units]
    padded = sum(lay.numel for lay in layouts)
    plan.add("host", "fp32 master weights", 4 * padded)
    plan.add("host", "fp32 Adam m + v", 8 * padded)
    biggest = max(lay.numel for lay in layouts[1:-1])
    cast_biggest = max(lay.cast_numel for lay in layouts[1:-1])

    def slot_bytes(lay) -> int:
        return compute_bytes * lay.cast_numel + 4 * (lay.numel - lay.cast_numel)

    from engine.stream import STAGING_ELEMS

    staging = 4 * min(STAGING_ELEMS, max(lay.cast_numel for lay in layouts))
    layer_slot = compute_bytes * cast_biggest + 4 * (biggest - cast_biggest)
    plan.add(compute_tier, "H2D staging buffer (fp32)", staging)
    plan.add(compute_tier, "embedding + head slots", slot_bytes(layouts[0]) + slot_bytes(layouts[-1]))
    plan.add(compute_tier, "residual stream + its gradient, all micro-batches", 2 * 4 * h * step_tokens)
    plan.add(compute_tier, "working activations (one layer + loss chunk)", act)

    ckpt_bytes = L * 4 * h * step_tokens
    grad_bytes = 4 * sum(lay.numel for lay in layouts)
    cache_bytes = sum(slot_bytes(lay) for lay in layouts[1:-1])
    ring_bytes = min(e.slots, L) * layer_slot
    side_grad_bytes = 4 * (layouts[0].numel + layouts[-1].numel + min(2, L) * biggest)
    margin_gib = 2.0 + 0.05 * gpu_gib
    if not on_gpu:  # one memory: forced tiers are honoured so CPU runs exercise every code path
        placement = {"checkpoint_tier": "gpu" if e.checkpoint_tier == "gpu" else "host",
                     "grads_tier": "gpu" if e.grads_tier == "gpu" else "host",
                     "cache_weights": "on" if e.cache_weights == "on" else "off"}
    else:
        # the smallest GPU set: a ring of layer slots and accumulators for embedding, head and two layers
        free = gpu_gib * GIB - plan.total("gpu") - ring_bytes - side_grad_bytes - margin_gib * GIB
        host_free = host_gib * GIB - plan.total("host") - 2 * GIB
        placement = {}

        def place(key: str, extra_gpu_bytes: int, forced: str) -> bool:
            nonlocal free
            on = forced == "gpu" or (forced == "auto" and extra_gpu_bytes <= free)
            if on:
                free -= extra_gpu_bytes
            placement[key] = "gpu" if on else "host"
            return on

        if not place("checkpoint_tier", ckpt_bytes, e.checkpoint_tier):
            host_free -= ckpt_bytes
        grads_extra = grad_bytes - side_grad_bytes
        grads_first = grad_bytes > host_free  # the host cannot hold them: they outrank the weight cache
        if grads_first:
            place("grads_tier", grads_extra, e.grads_tier)
        cache_on = place("cache_weights", cache_bytes - ring_bytes, {"on": "gpu", "off": "host"}.get(
            e.cache_weights, "auto"))
        placement["cache_weights"] = "on" if cache_on else "off"
        if not grads_first:
            place("grads_tier", grads_extra, e.grads_tier)
    plan.placement = placement
    plan.add(compute_tier if placement["checkpoint_tier"] == "gpu" else "host",
             "layer-input checkpoints (all micro-batches)", ckpt_bytes)
    if placement["grads_tier"] == "gpu":
        plan.add(compute_tier, "fp32 gradients of every unit until the norm is known", grad_bytes)
        plan.add("host", "pinned gradient staging (2 x largest unit)", 2 * 4 * max(lay.numel for lay in layouts))
    else:
        plan.add("host", "fp32 gradients until the global norm is known", grad_bytes)
        plan.add(compute_tier, "fp32 accumulators: embedding, head, 2 layers", side_grad_bytes)
    if placement["cache_weights"] == "on":
        plan.add(compute_tier, "layer slots: one per layer (weights cached fwd -> bwd)", cache_bytes)
    else:
        plan.add(compute_tier, f"layer slots: ring of {min(e.slots, L)}", ring_bytes)
    if on_gpu:
        plan.add("gpu", "allocator margin + CUDA context", int(margin_gib * GIB))
    return plan
