"""The planner: where every byte of state lives, and how long a step should take, decided before allocating.

Memory. For `engine=reference` everything sits on the compute device: fp32 master, gradient and two moments
(16 B/param), one kept layer input per layer per micro-batch and one layer's working activations.

For `engine=stream` the host holds fp32 master, m and v (12 B/param). The GPU holds the fixed working set: the H2D
staging buffer, the embedding and head slots, a ring of `engine.slots` layer slots, accumulators for the embedding,
the head and two layers, the residual stream (and its gradient) of every micro-batch, and one layer's working
activations. What is left of the GPU budget is spent in this order of benefit (DESIGN.md §4):
1. layer-input activations kept for the recompute (else pinned host memory, paid for with PCIe traffic);
2. full gradients waiting for the global norm, if the host could not hold them;
3. the optimizer state of the leading units (embedding, layer 1, ...): their update runs on the GPU, which
   takes work off the host AdamW, the one thing that can stall the next forward; as many as the time model says
   are needed for the host to stay ahead of the forward;
4. every layer's compute-dtype weights from forward to backward (saves the backward's H2D);
5. gradients anyway (saves 4 B/param of host RAM).
Any `engine.*` placement set explicitly overrides `auto`. A plan that does not fit raises PlanError with the table.

Time. `predict` models one step from the hardware profile: layer compute at `hardware.achieved_tflops` (what the
engine's matmuls sustain, measured), transfers at `h2d_gbps`/`d2h_gbps`, the host AdamW at
`cpu_adam_gparams_per_s` slowed by HOST_CONTENTION while PCIe streams (device.md: 0.23 s alone vs 0.32 s under
bidirectional streaming). Per layer, compute and its transfers overlap, so a layer costs the larger of the two.
The host update of step t runs unit by unit while step t+1's forward needs unit k at a given time; the model
replays that race and reports the forward's exposed wait. The binding resource is the one with the most busy time.
Activation working-set figures are estimates (bytes per token per layer, from the tensors autograd keeps in
`decoder_layer`); `margin_gib` covers allocator fragmentation and the CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from engine.metrics import model_flops_per_token

GIB = 2**30
HOST_CONTENTION = 0.72  # host AdamW rate while both PCIe directions stream, relative to alone (device.md)
STEP_OVERHEAD_S = 0.03  # per step: norm synchronisation, optimizer hand-off, Python


class PlanError(RuntimeError):
    pass


@dataclass
class MemoryPlan:
    engine: str
    rows: List[Tuple[str, str, int]] = field(default_factory=list)  # (tier, item, bytes)
    placement: Dict[str, object] = field(default_factory=dict)
    limits_gib: Dict[str, float] = field(default_factory=dict)
    times_s: Dict[str, float] = field(default_factory=dict)
    binding: str = ""

    def add(self, tier: str, item: str, nbytes: int) -> None:
        self.rows.append((tier, item, int(nbytes)))

    def total(self, tier: str) -> int:
        return sum(b for t, _, b in self.rows if t == tier)

    def problem(self) -> str:
        """Why the plan does not fit (every tier that overflows), or "" when it does."""
        over = [f"{self.total(tier) / GIB:.1f} GiB of {tier} memory where the hardware config allows {limit:.1f} GiB"
                for tier, limit in self.limits_gib.items() if limit and self.total(tier) > limit * GIB]
        if not over:
            return ""
        alternatives = "a smaller model or other hardware"
        if self.engine == "reference":
            alternatives += ", or engine=stream (state in host RAM)"
        return (f"The plan needs {' and '.join(over)}. Try fewer tokens per step (train.micro_batch_size, "
                f"train.grad_accum, train.seq_len), {alternatives}.")

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
        if self.times_s:
            lines.append("predicted step: " + ", ".join(f"{k} {v:.3f}s" for k, v in self.times_s.items())
                         + f"; bound by {self.binding}")
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
    plan = _reference(spec, cfg, gpu_gib, host_gib, on_gpu) if cfg.engine.name == "reference" else \
        _stream(spec, cfg, gpu_gib, host_gib, on_gpu)
    if check and plan.problem():
        raise PlanError(f"{plan.table()}\n\n{plan.problem()}")
    return plan


class _Shape:
    """The numbers both the memory and the time model need."""

    def __init__(self, spec, cfg, on_gpu: bool):
        t = cfg.train
        self.compute_bytes = 2 if on_gpu and t.compute_dtype != "fp32" else 4
        self.mb_tokens = t.micro_batch_size * t.seq_len
        self.step_tokens = self.mb_tokens * t.grad_accum
        self.h, self.L = spec.arch.hidden, spec.num_layers
        self.layouts = [u.layout for u in spec.units]
        self.layer_numel = max(lay.numel for lay in self.layouts[1:-1])
        self.layer_cast = max(lay.cast_numel for lay in self.layouts[1:-1])
        self.act = (layer_activation_bytes_per_token(spec, self.compute_bytes) * self.mb_tokens
                    + loss_activation_bytes(spec, self.mb_tokens))
        flops = model_flops_per_token(cfg.model, t.seq_len)
        self.layer_fwd_flops = flops["layer_forward_flops_per_token"] * self.step_tokens
        # the head runs forward twice (the step's forward and the fused loss's recompute) and backward once (2x)
        self.head_flops = 4 * flops["head_forward_flops_per_token"] * self.step_tokens

    def slot_bytes(self, lay) -> int:
        return self.compute_bytes * lay.cast_numel + 4 * (lay.numel - lay.cast_numel)


def _reference(spec, cfg, gpu_gib, host_gib, on_gpu) -> MemoryPlan:
    t, hw = cfg.train, cfg.hardware
    s = _Shape(spec, cfg, on_gpu)
    n = spec.num_params()
    tier = "gpu" if on_gpu else "host"
    plan = MemoryPlan(engine="reference", limits_gib={"gpu": gpu_gib if on_gpu else 0.0, "host": host_gib})
    plan.add(tier, "fp32 master weights", 4 * n)
    plan.add(tier, "fp32 gradients", 4 * n)
    plan.add(tier, "fp32 Adam m + v", 8 * n)
    plan.add(tier, "layer-input activations (one micro-batch)",
             (s.L if t.activation_checkpointing else 0) * 4 * s.h * s.mb_tokens)
    plan.add(tier, "working activations (one layer + loss chunk)", s.act * (1 if t.activation_checkpointing else s.L))
    if on_gpu and hw.achieved_tflops:
        tf = hw.achieved_tflops * 1e12
        recompute = 1 if t.activation_checkpointing else 0
        plan.times_s = {"forward": s.L * s.layer_fwd_flops / tf, "head": s.head_flops / tf,
                        "backward": (2 + recompute) * s.L * s.layer_fwd_flops / tf,
                        "optimizer": 28 * n / (3.0e12)}  # fused AdamW: 28 B/param through HBM
        plan.times_s["step"] = sum(plan.times_s.values()) + STEP_OVERHEAD_S
        plan.binding = "GPU compute"
    return plan


def predict_stream(spec, cfg, s: _Shape, placement: dict) -> Tuple[Dict[str, float], str, float]:
    """(phase times, binding resource, forward's exposed wait on the host optimizer) for a stream placement."""
    hw = cfg.hardware
    tf, h2d, d2h = hw.achieved_tflops * 1e12, hw.h2d_gbps * 1e9, hw.d2h_gbps * 1e9
    adam = hw.cpu_adam_gparams_per_s * 1e9 * HOST_CONTENTION
    n_dev = placement["device_optimizer_units"]
    cached = placement["cache_weights"] == "on"
    grads_host = placement["grads_tier"] == "host"
    activations_host = placement["activation_tier"] == "host"
    units = range(len(s.layouts))
    streamed = [0 if u < n_dev else 4 * s.layouts[u].numel for u in units]  # fp32 master over PCIe
    compute = [0.0] * len(s.layouts)
    for u in range(1, s.L + 1):
        compute[u] = s.layer_fwd_flops / tf
    layer_input_bytes = 4 * s.h * s.step_tokens  # one layer's inputs, all micro-batches
    fwd_extra = layer_input_bytes / d2h if activations_host else 0.0

    # the race: host update of unit u (in order, host units only) against the forward's need for it
    host_done, clock = [0.0] * len(s.layouts), 0.0
    for u in units:
        if u >= n_dev:
            clock += s.layouts[u].numel / adam
        host_done[u] = clock
    t_fwd, busy = 0.0, 0.0
    for u in range(0, s.L + 1):
        layer_time = max(compute[u], streamed[u] / h2d, fwd_extra if u else 0.0)
        t_fwd = max(t_fwd, host_done[u] + streamed[u] / h2d) + layer_time
        busy += layer_time
    t_fwd = max(t_fwd, host_done[-1] + streamed[-1] / h2d)  # the head's weights, updated last
    exposed = t_fwd - busy
    head = s.head_flops / tf
    bwd_layer = max(3 * s.layer_fwd_flops / tf,
                    0.0 if cached else 4 * s.layer_numel / h2d,
                    4 * s.layer_numel / d2h if grads_host else 0.0,
                    layer_input_bytes / h2d if activations_host else 0.0)
    backward = s.L * bwd_layer
    host_total = sum(s.layouts[u].numel for u in units if u >= n_dev) / adam
    times = {"forward": t_fwd, "head": head, "backward": backward, "host_optimizer": host_total,
             "exposed_optimizer_wait": exposed}
    times["step"] = t_fwd + head + backward + STEP_OVERHEAD_S
    busy_by = {"GPU compute": sum(compute) * 4 + head,
               "H2D": (sum(streamed) + (0 if cached else sum(streamed[1:-1]))) / h2d,
               "D2H": (4 * sum(lay.numel for lay in s.layouts) / d2h) if grads_host else 0.0,
               "host AdamW": host_total}
    return times, max(busy_by, key=busy_by.get), exposed


def _stream(spec, cfg, gpu_gib, host_gib, on_gpu) -> MemoryPlan:
    e, hw = cfg.engine, cfg.hardware
    s = _Shape(spec, cfg, on_gpu)
    layouts, L = s.layouts, s.L
    compute_tier = "gpu" if on_gpu else "host"
    plan = MemoryPlan(engine="stream", limits_gib={"gpu": gpu_gib if on_gpu else 0.0, "host": host_gib})

    from engine.streaming.slots import STAGING_ELEMS

    fixed = [
        ("H2D staging buffer (fp32)", 4 * min(STAGING_ELEMS, max(lay.cast_numel for lay in layouts))),
        ("embedding + head slots", s.slot_bytes(layouts[0]) + s.slot_bytes(layouts[-1])),
        ("residual stream + its gradient, all micro-batches", 2 * 4 * s.h * s.step_tokens),
        ("working activations (one layer + loss chunk)", s.act),
    ]
    ring_bytes = min(e.slots, L) * (s.compute_bytes * s.layer_cast + 4 * (s.layer_numel - s.layer_cast))
    side_grad_bytes = 4 * (layouts[0].numel + layouts[-1].numel + min(2, L) * s.layer_numel)
    activation_bytes = L * 4 * s.h * s.step_tokens
    grad_bytes = 4 * sum(lay.numel for lay in layouts)
    cache_bytes = sum(s.slot_bytes(lay) for lay in layouts[1:-1])
    margin_gib = 2.0 + 0.05 * gpu_gib if on_gpu else 0.0
    state_bytes = [12 * lay.numel for lay in layouts]  # fp32 master + m + v

    placement: Dict[str, object] = {}
    if not on_gpu:  # one memory: explicit choices are honoured so CPU runs exercise every code path
        placement = {"activation_tier": "gpu" if e.activation_tier == "gpu" else "host",
                     "grads_tier": "gpu" if e.grads_tier == "gpu" else "host",
                     "cache_weights": "on" if e.cache_weights == "on" else "off",
                     "device_optimizer_units": max(0, e.device_optimizer_units)}
    else:
        free = gpu_gib * GIB - sum(b for _, b in fixed) - ring_bytes - side_grad_bytes - margin_gib * GIB
        host_free = host_gib * GIB - sum(state_bytes) - 2 * GIB

        def place(key: str, extra_gpu_bytes: int, forced: str) -> bool:
            nonlocal free
            on = forced == "gpu" or (forced == "auto" and extra_gpu_bytes <= free)
            if on:
                free -= extra_gpu_bytes
            placement[key] = "gpu" if on else "host"
            return on

        if not place("activation_tier", activation_bytes, e.activation_tier):
            host_free -= activation_bytes
        grads_first = grad_bytes > host_free  # the host cannot hold them: they outrank everything below
        if grads_first:
            place("grads_tier", grad_bytes - side_grad_bytes, e.grads_tier)
        placement["cache_weights"] = "off"
        placement.setdefault("grads_tier", "host")
        placement["device_optimizer_units"] = 0
        if e.device_optimizer_units >= 0:
            n_dev = min(e.device_optimizer_units, len(layouts))
            free -= sum(state_bytes[:n_dev])
        else:
            n_dev = 0
            while n_dev < len(layouts) - 1 and hw.achieved_tflops:
                times, _, exposed = predict_stream(spec, cfg, s, {**placement, "device_optimizer_units": n_dev})
                if exposed <= 0.01 * times["step"] or state_bytes[n_dev] > free:
                    break
                free -= state_bytes[n_dev]
                n_dev += 1
        placement["device_optimizer_units"] = n_dev
        cache_on = place("cache_weights", cache_bytes - ring_bytes,
                         {"on": "gpu", "off": "host"}.get(e.cache_weights, "auto"))
        placement["cache_weights"] = "on" if cache_on else "off"
        if not grads_first:
            place("grads_tier", grad_bytes - side_grad_bytes, e.grads_tier)
    plan.placement = placement

    n_dev = placement["device_optimizer_units"]
    host_state = sum(state_bytes[n_dev:])
    plan.add("host", f"fp32 master, Adam m + v: {len(layouts) - n_dev} units updated on the host", host_state)
    for item, nbytes in fixed:
        plan.add(compute_tier, item, nbytes)
    if n_dev:
        plan.add(compute_tier, f"fp32 master, Adam m + v: {n_dev} leading units updated on the GPU",
                 sum(state_bytes[:n_dev]))
    plan.add(compute_tier if placement["activation_tier"] == "gpu" else "host",
             "layer-input activations (all micro-batches)", activation_bytes)
    if placement["grads_tier"] == "gpu":
        plan.add(compute_tier, "fp32 gradients of every unit until the norm is known", grad_bytes)
        plan.add("host", "pinned gradient staging (2 x largest unit)",
                 2 * 4 * max((lay.numel for lay in layouts[n_dev:]), default=0))
    else:
        plan.add("host", "fp32 gradients until the global norm is known", grad_bytes)
        plan.add(compute_tier, "fp32 accumulators: embedding, head, 2 layers (+ GPU-updated layers)",
                 side_grad_bytes + 4 * sum(lay.numel for lay in layouts[1:min(n_dev, L + 1)]))
    if placement["cache_weights"] == "on":
        plan.add(compute_tier, "layer slots: one per layer (weights cached fwd -> bwd)", cache_bytes)
    else:
        plan.add(compute_tier, f"layer slots: ring of {min(e.slots, L)} (+ one per GPU-updated layer)",
                 ring_bytes + sum(s.slot_bytes(lay) for lay in layouts[1:min(n_dev, L + 1)]))
    if on_gpu:
        plan.add("gpu", "allocator margin + CUDA context", int(margin_gib * GIB))
        if hw.achieved_tflops:
            plan.times_s, plan.binding, _ = predict_stream(spec, cfg, s, placement)
    return plan
