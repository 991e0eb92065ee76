"""The calibrated speeds the time model runs on: the hardware profile's figures for the mode the run executes in
(compiled or eager), at the run's layer width."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    from engine.plan.shape import StepShape


class MoeShape(NamedTuple):
    """What a mixture-of-experts layer's rate depends on besides its tokens: the expert matmuls' two dimensions and
    the share of the tokens each expert gets."""
    hidden: int
    experts: int
    experts_per_token: int
    expert_width: int

    @classmethod
    def of(cls, spec) -> Optional["MoeShape"]:
        """The shape of a ModelSpec's MoE layers; None for a dense model."""
        if not spec.moe:
            return None
        a = spec.arch
        return cls(a.hidden, a.experts, a.top_k, a.expert_intermediate)

    def distance(self, other: "MoeShape") -> float:
        """How far apart two shapes are: log ratios of the hidden size, the expert width and the tokens' share per
        expert, summed (0: the same shape)."""
        share = (self.experts_per_token / self.experts) / (other.experts_per_token / other.experts)
        return (abs(math.log(self.hidden / other.hidden)) + abs(math.log(self.expert_width / other.expert_width))
                + abs(math.log(share)))

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.experts} experts, top-{self.experts_per_token}, expert width "
                f"{self.expert_width}")


class Speeds:
    """The profile's calibrated figures (`python -m engine.calibrate`) for the mode the run executes in: compiled
    templates or eager. `known` is false when the profile has none for that mode (no time prediction, no split search).

    A layer's time is its attention FLOPs at the attention rates plus its other FLOPs at the layer rates when the
    profile has attention figures; without them the layer rates time all of it, which is right only near the
    calibration's length (qwen7b's attention is 5% of its FLOPs at 4K tokens per sequence, a third at 32K, 88% at
    512K; one rate fitted at 4K made the 32K step 17% short on an H200). `attention`: the run's backend, named in
    `describe` when it is not the one the attention figures were measured with; `seq_len`: the run's tokens per
    sequence, where the figures of that backend are read (`attention_rates`; 0: the main figures). `moe`: the shape
    of the model's MoE layers (None: a dense model), timed with the profile's MoE figures where it has them, at
    `mb_tokens` tokens per layer call (`moe_rates`), slowed by `hardware.moe_step_ratio`. `lean`: the layers run
    lean (engine/model/lean.py), at `hardware.lean_step_ratio_<attention>` times these figures' time (measured on a
    dense layer; MoE layers are assumed to pay the same)."""

    def __init__(self, hw, compiled: bool, attention: str = "", moe: Optional[MoeShape] = None, hidden: int = 0,
                 seq_len: int = 0, lean: bool = False, mb_tokens: int = 0):
        mode = "compiled" if compiled else "eager"
        self.mode = mode
        # the lean layer's steps run this much longer than their FLOPs at the rates below (1: not measured)
        self.lean_ratio = (hw.get(f"lean_step_ratio_{attention}", 0.0) or 1.0) if lean else 1.0
        rates, self.width_note = width_rates(hw, mode, hidden)
        self.fwd, self.bwd, self.head = (r * 1e12 for r in rates)
        # a MoE model's layers at the figures of a measured MoE layer where the profile has them
        self.moe_note = ""
        if moe is not None:
            moe_tflops, self.moe_note = moe_rates(hw, mode, moe, mb_tokens)
            if moe_tflops is not None:
                in_step = hw.moe_step_ratio or 1.0  # a layer alone runs faster than inside a step
                self.fwd, self.bwd = (r * 1e12 / in_step for r in moe_tflops)
                if hw.moe_step_ratio:
                    self.moe_note += f", at {in_step:.3g}x their time inside steps (hardware.moe_step_ratio)"
        self.attn_calibrated = min(hw.attn_fwd_tflops, hw.attn_bwd_tflops) > 0
        # without attention figures the layer rates time the attention too
        self.attn_fwd, self.attn_bwd = self.fwd, self.bwd
        self.attn_note = "attention timed at the layer's rate (no attention figures)"
        if self.attn_calibrated:
            rates, self.attn_note = attention_rates(hw, attention, seq_len)
            self.attn_fwd, self.attn_bwd = (r * 1e12 for r in rates)
        self.h2d, self.d2h, self.bidir = hw.h2d_gbps * 1e9, hw.d2h_gbps * 1e9, hw.bidir_gbps * 1e9
        # the link's rate while the host AdamW runs, as a fraction of its rate alone (page-locked DMA and the
        # optimizer share host memory bandwidth); 1 where the profile has no such figure
        self.link_under_adam = min(1.0, hw.bidir_gbps_under_adam / hw.bidir_gbps) \
            if hw.bidir_gbps_under_adam > 0 and hw.bidir_gbps > 0 else 1.0
        # the host AdamW always runs while the forward streams: its rate measured inside training steps where the
        # profile has it, else the calibration's under PCIe load
        self.adam_pcie = (hw.cpu_adam_gparams_per_s_in_step or hw.cpu_adam_gparams_per_s_under_pcie) * 1e9
        self.nvme = hw.nvme_gbps * 1e9  # 0: unknown, the tier's I/O is not timed
        self.known = min(self.fwd, self.bwd, self.head) > 0

    @classmethod
    def of_step(cls, hw, spec, s: "StepShape", compiled: bool) -> "Speeds":
        """The speeds of a planned step: its model's width and MoE shape, its attention backend, tokens per sequence
        and per layer call, and whether its layers run lean."""
        return cls(hw, compiled, s.attention, MoeShape.of(spec), spec.arch.hidden, s.seq_len, s.lean, s.mb_tokens)

    def layer_fwd_s(self, s: "StepShape", forwards: int = 1) -> float:
        """Seconds of `forwards` forwards of one layer over the step's tokens, run without autograd."""
        other = s.layer_fwd_flops - s.layer_attn_fwd_flops
        return forwards * (other / self.fwd + s.layer_attn_fwd_flops / self.attn_fwd) * self.lean_ratio

    def layer_bwd_s(self, s: "StepShape", forwards: int, skipped_flops: float = 0.0,
                    attention_forwards: Optional[int] = None) -> float:
        """Seconds of one layer's backward work worth `forwards` forwards of FLOPs (3: a forward with autograd, then
        the backward's two; 2 for a kept graph) less `skipped_flops` of its recompute, at the backward rates, plus a
        chunked MLP's recompute of its checkpointed chunks (one MLP forward, at the forward rate). The attention's
        share counts `attention_forwards` forwards where given (2: a lean layer with its attention output kept)."""
        other = forwards * (s.layer_fwd_flops - s.layer_attn_fwd_flops) - skipped_flops
        attention_passes = forwards if attention_forwards is None else attention_forwards
        attention = attention_passes * s.layer_attn_fwd_flops / self.attn_bwd
        return (other / self.bwd + attention + s.mlp_recompute_flops / self.fwd) * self.lean_ratio

    def describe(self, hw) -> str:
        line = f"speeds: the {self.mode} figures of hardware={hw.name}; calibration: {hw.calibration or 'none'}"
        if self.width_note:
            line += f"; {self.width_note}"
        line += f"; {self.attn_note}"
        if self.lean_ratio != 1.0:
            line += f"; the lean layer at {self.lean_ratio:.3g}x that (hardware.lean_step_ratio_*)"
        if hw.cpu_adam_gparams_per_s_in_step > 0:
            line += f"; the host AdamW at its in-step rate, {hw.cpu_adam_gparams_per_s_in_step:.3g} G parameters/s"
        if self.moe_note:
            line += f"; {self.moe_note}"
        return line


def moe_rates(hw, mode: str, shape: MoeShape, mb_tokens: int) -> Tuple[Optional[Tuple[float, float]], str]:
    """((fwd, bwd) TFLOPS, how they were found) for MoE layers of `shape` at `mb_tokens` tokens per layer call, from
    the profile's `moe_layers` measured in `mode`: the entries of the run's own layer shape, or else of the nearest
    measured one (`MoeShape.distance`), interpolated linearly in log(tokens) between the two nearest token counts,
    the nearest one's outside them. (None, why) when the profile has no MoE figures for `mode`: the layers are then
    timed at the dense layer's figures, far too fast for their grouped matmuls, gathers and scatters."""
    entries = [e for e in hw.moe_layers if e[f"fwd_tflops_{mode}"] > 0]
    if not entries:
        return None, (f"MoE layers are timed at a dense layer's figures (the profile has no {mode} MoE figures: "
                      "python -m engine.calibrate --moe-models): expect a longer step, the backward most")

    def shape_of(e) -> MoeShape:
        return MoeShape(e.hidden, e.experts, e.experts_per_token, e.expert_width)

    nearest = min(entries, key=lambda e: (shape.distance(shape_of(e)), e.model))
    points = sorted((e.tokens, (float(e[f"fwd_tflops_{mode}"]), float(e[f"bwd_tflops_{mode}"])))
                    for e in entries if shape_of(e) == shape_of(nearest))
    rates, lo, hi = _on_log_axis(points, mb_tokens)
    note = f"MoE layers at the figures of {nearest.model}'s layer"
    if shape_of(nearest) != shape:
        note += f" (the nearest calibrated MoE layer to this model's: {shape.describe()})"
    if lo is not hi:
        note += f", interpolated for {mb_tokens} tokens a layer call between {lo[0]} and {hi[0]}"
    else:
        note += f" at {lo[0]} tokens a layer call" + ("" if lo[0] == mb_tokens else f" (this run: {mb_tokens})")
    return rates, note


def attention_rates(hw, backend: str, seq_len: int) -> Tuple[Tuple[float, float], str]:
    """((fwd, bwd) attention TFLOPS, how they were found) for a run of `backend` at `seq_len` tokens per sequence.
    The profile's main attention figures and its `attn_points` are (backend, length) points: the run's backend's
    points, or the main backend's where it has none (said in the note), give rates interpolated linearly in
    log(length) between the two nearest lengths, the nearest point's outside them; `seq_len` 0 takes the main
    figures."""
    main = (hw.attn_backend, hw.attn_seq_len, (float(hw.attn_fwd_tflops), float(hw.attn_bwd_tflops)))
    points = [main] + [(p.backend, p.seq_len, (float(p.fwd_tflops), float(p.bwd_tflops))) for p in hw.attn_points]
    if seq_len < 1:
        return main[2], f"attention at the figures of {main[0]} at {main[1]} tokens"
    source, note = backend, ""
    if not any(p[0] == backend for p in points):
        source, note = main[0], f" (the profile has no {backend} figures: this run's attention is timed as {main[0]})"
    rates, lo, hi = _on_log_axis(sorted(p[1:] for p in points if p[0] == source), seq_len)
    if lo is not hi:
        return rates, (f"attention at {source}'s figures interpolated for {seq_len} tokens between {lo[0]} and "
                       f"{hi[0]}{note}")
    nearest = "" if lo[0] == seq_len else ", the nearest measured length"
    return rates, f"attention at the figures of {source} at {lo[0]} tokens{nearest}{note}"


def width_rates(hw, mode: str, hidden: int) -> Tuple[Tuple[float, float, float], str]:
    """((fwd, bwd, head) TFLOPS, how they were found) for layers `hidden` wide in `mode`. The profile's main figures
    (measured at `layer_hidden`) and those of `layer_widths` are points on a hidden-size axis: a width between two
    of them gets rates interpolated linearly in log(hidden), one outside them the nearest point's. The note is ""
    when the main figures serve as they are (no other width in the profile, or the run's width unknown)."""
    keys = tuple(f"{k}_tflops_{mode}" for k in ("fwd", "bwd", "head"))
    main = tuple(float(hw[k]) for k in keys)
    points = [(w.hidden, w.model, tuple(float(w[k]) for k in keys)) for w in hw.layer_widths if w[keys[0]] > 0]
    if hidden < 1 or not points or hw.layer_hidden < 1 or main[0] <= 0:
        return main, ""
    points = sorted(points + [(hw.layer_hidden, hw.layer_model, main)])
    rates, (h0, m0, _), (h1, m1, _) = _on_log_axis(points, hidden)
    if h0 != h1:
        return rates, (f"layers at rates interpolated for width {hidden} between calibrated widths {h0} ({m0}) and "
                       f"{h1} ({m1})")
    if h0 == hidden:
        return rates, f"layers at the figures of calibrated width {h0} ({m0})"
    named = ", ".join(f"{h} ({m})" for h, m, _ in points)
    return rates, (f"layers at the figures of the nearest calibrated width, {h0} ({m0}); this model's {hidden} is "
                   f"outside the calibrated widths {named}")


def _on_log_axis(points, x: float):
    """(rates at x, the point below, the point above) from points (position, ..., rates tuple) sorted by position:
    the rates interpolated linearly in log(position) between the nearest point on each side; at a point, or outside
    them, that point's rates, with that one point as both neighbours."""
    below = [p for p in points if p[0] <= x]
    above = [p for p in points if p[0] >= x]
    if not below or not above or below[-1][0] == above[0][0]:
        point = above[0] if not below else below[-1]
        return point[-1], point, point
    lo, hi = below[-1], above[0]
    t = math.log(x / lo[0]) / math.log(hi[0] / lo[0])
    return tuple(a + t * (b - a) for a, b in zip(lo[-1], hi[-1])), lo, hi
