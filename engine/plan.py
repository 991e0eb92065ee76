"""The planner: where every byte of state lives, and how long a step should take, decided before allocating.

Memory. Every state byte is counted in the run's formats (engine/formats.py: fp32 master + m + v is 12 B/param, a
4 B/param gradient; bf16 master + int8 moments + bf16 gradient about 6). For `engine=reference` everything sits on
the compute device: master, gradient and two moments, one kept layer input per layer per micro-batch and one layer's
working activations.

For `engine=stream` each unit is updated in one of three places (DESIGN.md §4), in forward order: the first
`gpu_resident_units` keep master, m and v in HBM; the next `gpu_streamed_units` keep them in host RAM (pinned) and
are updated on the GPU as the next forward loads them; the rest are updated by the host AdamW, which runs the exact
fp32 formats only (any other format puts every unit in the first two places). The
GPU holds the fixed working set: the H2D staging buffer, the embedding and head slots, a ring of `engine.slots`
layer slots, accumulators for the embedding, the head and two layers, the residual stream (and its gradient) of
every micro-batch, one layer's working activations (or the loss chunk's, the larger: they are live in different
phases) and the autograd graphs of the last `keep_activation_layers` layers; with -1 every count from 0 up is
planned as below and the fastest predicted plan over all counts and splits wins. What is left of the GPU budget is
spent in this order:
1. layer-input activations kept for the recompute (else pinned host memory, paid for with PCIe traffic);
2. full gradients waiting for the global norm, if the host could not hold them (or the config says so);
3. the split of the units among the three places: every split that fits is predicted with the time model and the
   fastest is taken (among those within 1% of it, the one with the most slack; `choose_split`);
4. every layer's compute-dtype weights from forward to backward (saves the backward's H2D);
5. gradients anyway (saves 4 B/param of host RAM).
Any `engine.*` placement set explicitly overrides `auto` / -1. A plan that does not fit raises PlanError with the
table and, where smaller state formats would fit, up to three of them (the most precise first) with their totals.
The GPU figures are tensor memory (`allocated`, what `torch.cuda.max_memory_allocated` measures) plus a reserved
margin for the allocator's fragmentation and the CUDA context that the budget keeps free.

NVMe tier (`hardware.nvme_dir`, `hardware.nvme_gib`; engine/streaming/nvme.py). The Adam moments of the last
`engine.nvme_units` host-updated decoder layers may live in a file on a local disk: host RAM keeps their master
(4 B/param) and three staging buffers of one layer's m + v; the disk holds 8 B/param (each region padded to 4 KiB).
With -1 the planner moves layers there, last first, only as far as the host needs to fit, within
`nvme_gib`; the exact fp32 formats only (they are the ones with host-updated units). Time: each such unit's update
takes the longer of its AdamW and reading + writing its moments at `hardware.nvme_gbps`.

Recompute groups (`engine.recompute_group` = g). At long context the kept layer inputs (4 B x hidden per token
per layer) outgrow both tiers: qwen7b at 512K tokens keeps 7 GiB per layer, 196 GiB in all. With g > 1 only the
inputs with index i % g == 0 (0-based) of the n recomputed layers are kept, one per group of g consecutive layers;
when the backward reaches a group (at its last layer) the engine reruns the group's forward without autograd from
the kept input and holds the group's inputs of every micro-batch on the GPU until their layers' backward has run.
Memory: the layer-input row counts the ceil(n / g) kept inputs, on its tier; a GPU row, whatever that tier, holds one
group's regenerated inputs (min(g, n) layers' worth). Time: s - 1 extra layer forwards per group of s layers at the
forward's speed, and the weights of those s - 1 layers loaded once more unless GPU-resident or cached. With -1, g = 1
is planned exactly as without groups; only when nothing fits are g = 2, 3, ... n tried, and the smallest with which
the plan fits wins (the extra forwards grow with g). A g that a bound rules out (HBM must hold the working set and
one group, the host whatever of the state, the kept inputs and the gradients the rest of HBM cannot) is skipped
without a search; a refusal shows the g = 1 plan and says that no g fitted.

Time. `predict_stream` models one step from the calibrated figures of the hardware profile (bench/calibrate.py
measures them on the machine, for compiled and for eager templates: the planner uses the mode the run executes in,
never a figure fitted on the run it predicts): layer forward and backward (recompute included) TFLOPS, the head's,
H2D/D2H alone and both at once, the host AdamW alone and under PCIe load. The forward is a pipeline of the H2D
stream, the D2H stream, the host AdamW and compute (see `predict_stream`); `exposed_wait` is the forward's time
beyond its compute. Activation working-set figures are estimates (bytes per token per layer, from the tensors
autograd keeps in `decoder_layer`); `margin_gib` covers allocator fragmentation and the CUDA context on the GPU;
`hardware.host_process_gib` (calibrated) is the process's own host memory before any state, less
`hardware.host_compile_workers_gib` (torch.compile's worker processes) for a run that starts none (eager templates,
or `train.compile_in_process`); a refusal says when the plan would fit without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from engine.config import ConfigError
from engine.distributed import state_owners
from engine.formats import StateFormat, all_formats
from engine.metrics import model_flops_per_token
from engine.model.attention import HAVE_FLASH_ATTN, resolve_attention
from engine.model import moe
from engine.model.dense import mlp_chunked, resolve_mlp_chunk_tokens

GIB = 2**30
HBM_ADAMW_BYTES_PER_S = 3.0e12  # fused CUDA AdamW: ~28 B/param of HBM traffic at about 3 TB/s
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
    speeds: str = ""  # where the time model's figures come from
    suggestions: List[str] = field(default_factory=list)  # smaller state formats that fit, for a refusal
    notes: List[str] = field(default_factory=list)  # for a refusal: what else was tried

    reserved: Dict[str, int] = field(default_factory=dict)  # bytes per tier held back, not allocated as tensors

    def add(self, tier: str, item: str, nbytes: int) -> None:
        self.rows.append((tier, item, int(nbytes)))

    def reserve(self, tier: str, item: str, nbytes: int) -> None:
        """A row the budget must leave free (allocator fragmentation, the CUDA context) but that no tensor fills:
        it counts in `total`, not in `allocated`."""
        self.add(tier, item, nbytes)
        self.reserved[tier] = self.reserved.get(tier, 0) + int(nbytes)

    def total(self, tier: str) -> int:
        return sum(b for t, _, b in self.rows if t == tier)

    def allocated(self, tier: str) -> int:
        """The predicted peak of tensor memory in `tier` (what `torch.cuda.max_memory_allocated` measures)."""
        return self.total(tier) - self.reserved.get(tier, 0)

    def overflow_bytes(self) -> int:
        """Bytes beyond the limits, summed over the tiers."""
        return sum(max(0, self.total(tier) - int(limit * GIB)) for tier, limit in self.limits_gib.items() if limit)

    def problem(self) -> str:
        """Why the plan does not fit (every tier that overflows), or "" when it does."""
        over = [f"{self.total(tier) / GIB:.1f} GiB of {tier} memory where the hardware config allows {limit:.1f} GiB"
                for tier, limit in self.limits_gib.items() if limit and self.total(tier) > limit * GIB]
        if not over:
            return ""
        alternatives = "a smaller model or other hardware"
        if self.engine == "reference":
            alternatives += ", or engine=stream (state in host RAM)"
        text = (f"The plan needs {' and '.join(over)}. {''.join(note + ' ' for note in self.notes)}Try fewer "
                f"tokens per step (train.micro_batch_size, train.grad_accum, train.seq_len), {alternatives}.")
        if self.suggestions:
            text += " Smaller training-state formats that fit (engine/formats.py):\n" + "\n".join(self.suggestions)
        return text

    def table(self) -> str:
        lines = [f"memory plan (engine={self.engine})", f"{'tier':6} {'item':66} {'GiB':>10}"]
        for tier, item, nbytes in self.rows:
            lines.append(f"{tier:6} {item:66} {nbytes / GIB:10.3f}")
        for tier in ("gpu", "host", "nvme"):
            if tier == "nvme" and not self.total(tier):
                continue
            limit = self.limits_gib.get(tier)
            lim = f" of {limit:.1f} GiB" if limit else ""
            lines.append(f"{tier:6} {'TOTAL':66} {self.total(tier) / GIB:10.3f}{lim}")
        if self.placement:
            lines.append("placement: " + ", ".join(f"{k}={v}" for k, v in self.placement.items()))
        if self.times_s:
            lines.append("predicted step: " + ", ".join(f"{k} {v:.3f}s" for k, v in self.times_s.items())
                         + f"; bound by {self.binding}")
            lines.append(self.speeds)
        return "\n".join(lines)


def kept_layer_inputs(num_layers: int, keep_activation_layers: int, recompute_group: int) -> range:
    """The 0-based indices of the layer inputs the forward keeps for the backward: of the recomputed layers (all but
    the last `keep_activation_layers`, whose graphs are kept instead), the first of each recompute group."""
    return range(0, num_layers - keep_activation_layers, recompute_group)


def layer_activation_bytes_per_token(spec, compute_bytes: int, compiled: bool = True, mlp: bool = True) -> int:
    """Bytes per token one decoder layer's autograd graph keeps (the tensors saved-tensor hooks list around
    `decoder_layer` under autocast; the layer input itself is counted with the layer-input activations).
    `mlp=False`: without the MLP block's share (a chunked MLP keeps only its chunk inputs, which are the residual
    after attention, counted either way).

    Compiled (the partitioner keeps what the backward needs, in the compute dtype where it can): the two RMSNorm
    reciprocals and normed inputs, roped q and k, v, the attention output and its log-sum-exp, the residual after
    attention (fp32), gate, up and their product; with qk-norm, q and k before it and its reciprocals.
    Eager saves more (1.5-1.8x; tests/test_plan.py measures it on the CPU under bf16 autocast): each RMSNorm keeps
    its fp32 output, and each of the five projections of a normed input (q, k, v, gate, up) keeps its own autocast
    copy of it; SwiGLU keeps silu(gate) as well; SDPA keeps its output and the o_proj keeps the transposed copy;
    qk-norm keeps its fp32 upcast of q and k. A MoE layer's MLP share is its routed block's
    (engine/model/moe.py `activation_bytes_per_token`)."""
    a = spec.arch
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    fp32 = 4
    shared = (fp32  # the input norm's reciprocal
              + compute_bytes * (q + 2 * kv)  # roped q, k and v
              + compute_bytes * q + fp32 * a.heads  # attention output, log-sum-exp
              + fp32 * a.hidden)  # residual after attention
    if a.qk_norm:  # q and k before their norm, and the norms' reciprocals per head
        shared += compute_bytes * (q + kv) + fp32 * (a.heads + a.kv_heads)
    if compiled:
        attention = shared + compute_bytes * a.hidden
    else:
        attention_copy = 0 if HAVE_FLASH_ATTN else compute_bytes * q
        qk_norm_fp32 = fp32 * (q + kv) if a.qk_norm else 0  # eager qk-norm keeps its fp32 upcast too
        attention = shared + qk_norm_fp32 + fp32 * a.hidden + compute_bytes * a.hidden * 3 + attention_copy
    if not mlp:
        return attention
    if spec.moe:  # the routed block: router, gathered rows, expert intermediates, index tensors
        return attention + moe.activation_bytes_per_token(a, compute_bytes, compiled)
    if compiled:
        return attention + fp32 + compute_bytes * a.hidden + compute_bytes * a.intermediate * 3
    return attention + fp32 + fp32 * a.hidden + compute_bytes * a.hidden * 2 + compute_bytes * a.intermediate * 4


def layer_graph_bytes(spec, tokens: int, compute_bytes: int, compiled: bool, mlp_chunk_tokens: int) -> int:
    """What one layer's autograd graph over `tokens` tokens keeps; a chunked MLP (`mlp_chunk_tokens > 0` and fewer
    than `tokens`) keeps none of its intermediates."""
    mlp = not mlp_chunked(mlp_chunk_tokens, tokens)
    return layer_activation_bytes_per_token(spec, compute_bytes, compiled, mlp=mlp) * tokens


def layer_working_bytes(spec, tokens: int, compute_bytes: int, compiled: bool, mlp_chunk_tokens: int,
                        attention: str) -> int:
    """A recomputed layer's working set: its graph plus the gradients of the same tensors, live transiently; a
    chunked MLP adds one chunk's intermediates, rebuilt in the backward. `attention`: the resolved backend; torch's
    SDPA computes a GQA backward (fewer K/V heads than query heads) on K and V expanded to the query heads, and
    their gradients at that width, before it sums them back: four [tokens, heads x head_dim] tensors (measured on
    an H100 at 128K tokens, qwen7b's 28/4 heads: 3.24 GiB above the Triton kernel's backward, 93% of this count)."""
    graph = layer_graph_bytes(spec, tokens, compute_bytes, compiled, mlp_chunk_tokens)
    if 0 < mlp_chunk_tokens < tokens:
        mlp_per_token = (layer_activation_bytes_per_token(spec, compute_bytes, compiled)
                         - layer_activation_bytes_per_token(spec, compute_bytes, compiled, mlp=False))
        graph += mlp_per_token * mlp_chunk_tokens
    a = spec.arch
    gqa_expanded = 4 * compute_bytes * a.heads * a.head_dim * tokens if attention == "sdpa" and \
        a.kv_heads < a.heads else 0
    return int(graph * 1.5) + gqa_expanded


def loss_activation_bytes(spec, tokens: int, compute_bytes: int, fused: bool) -> int:
    """The head's working memory for one micro-batch of `tokens`."""
    from engine.model.dense import FUSED_LOSS_CHUNK_ELEMS, LOSS_CHUNK_ELEMS

    a = spec.arch
    if fused:  # one chunk of logits, the saved dh and the fp32 dW (+ its copy in the weight's dtype)
        chunk = min(tokens, max(1, FUSED_LOSS_CHUNK_ELEMS // a.vocab))
        return (compute_bytes * chunk * a.vocab + compute_bytes * tokens * a.hidden
                + (4 + compute_bytes) * a.vocab * a.hidden + 4 * tokens * a.hidden)
    chunk = min(tokens, max(1, LOSS_CHUNK_ELEMS // a.vocab))
    return chunk * a.vocab * (2 + 4 + 4)  # bf16 logits, fp32 upcast, its gradient


def build_plan(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, check: bool = True,
               state_ranks: int = 1) -> MemoryPlan:
    """`state_ranks`: the data-parallel ranks the stream engine's host state is sharded over (engine/distributed.py);
    the host rows are those of the rank holding the most."""
    fmt = StateFormat.of(cfg.train)
    plan = _engine_plan(spec, cfg, gpu_gib, host_gib, on_gpu, state_ranks)
    if plan.problem():
        plan.suggestions = formats_that_fit(spec, cfg, gpu_gib, host_gib, on_gpu, fmt, state_ranks)
        plan.notes.extend(in_process_compile_fits(spec, cfg, gpu_gib, host_gib, on_gpu, state_ranks))
    if check and plan.problem():
        raise PlanError(f"{plan.table()}\n\n{plan.problem()}")
    return plan


def _engine_plan(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, state_ranks: int) -> MemoryPlan:
    """The unchecked plan of `cfg.engine` in the config's state format."""
    fmt = StateFormat.of(cfg.train)
    if cfg.engine.name == "reference":
        return _reference(spec, cfg, gpu_gib, host_gib, on_gpu, fmt)
    return _stream(spec, cfg, gpu_gib, host_gib, on_gpu, fmt, state_ranks)


def in_process_compile_fits(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, state_ranks: int) -> List[str]:
    """For a refusal of a run that would start Inductor's compile workers: a note when the plan fits without them
    (`train.compile_in_process=true`), else nothing."""
    if not compile_workers_on(cfg, on_gpu) or not cfg.hardware.host_compile_workers_gib:
        return []
    try:
        plan = _engine_plan(spec, OmegaConf.merge(cfg, {"train": {"compile_in_process": True}}), gpu_gib, host_gib,
                            on_gpu, state_ranks)
    except PlanError:
        return []
    if plan.problem():
        return []
    return [f"With train.compile_in_process=true (the compiled kernels built in this process, no worker pool: "
            f"{cfg.hardware.host_compile_workers_gib:.1f} GiB less host) it fits: host {plan.total('host') / GIB:.1f} "
            f"GiB, GPU {plan.total('gpu') / GIB:.1f} GiB."]


def formats_that_fit(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, current: StateFormat,
                     state_ranks: int, limit: int = 3) -> List[str]:
    """For a refusal: up to `limit` smaller state formats with which the streaming engine's plan fits (the most
    precise first), each with its host and GPU totals; the rest of the config is kept, the sharding too."""
    found = []
    for fmt in all_formats(current.block_size):
        if fmt.bytes_per_param() >= current.bytes_per_param():
            continue
        try:
            plan = _stream(spec, cfg, gpu_gib, host_gib, on_gpu, fmt, state_ranks)
        except PlanError:  # the config fixes a placement this format cannot take
            continue
        if not plan.problem():
            engine = "engine=stream " if cfg.engine.name != "stream" else ""
            g = plan.placement["recompute_group"]
            groups = f" engine.recompute_group={g}" if g > 1 else ""
            found.append(f"model={cfg.model.name}: fits with {engine}{fmt.overrides()}{groups}: "
                         f"host {plan.total('host') / GIB:.1f} GiB, GPU {plan.total('gpu') / GIB:.1f} GiB")
            if len(found) == limit:
                break
    return found


class _Shape:
    """The numbers both the memory and the time model need."""

    def __init__(self, spec, cfg, on_gpu: bool, fmt: StateFormat, state_ranks: int = 1):
        t = cfg.train
        self.spec = spec
        self.fmt = fmt
        self.state_ranks = state_ranks  # data-parallel ranks the host state is sharded over (engine/distributed.py)
        self.grad_transfer = t.grad_transfer_dtype  # the dtype host-updated units' gradients cross the link in
        self.compute_bytes = 2 if on_gpu and t.compute_dtype != "fp32" else 4
        self.mb_tokens = t.micro_batch_size * t.seq_len
        self.step_tokens = self.mb_tokens * t.grad_accum
        self.h, self.L = spec.arch.hidden, spec.num_layers
        self.layouts = [u.layout for u in spec.units]
        self.layer_numel = max(lay.numel for lay in self.layouts[1:-1])
        self.layer_cast = max(lay.cast_numel for lay in self.layouts[1:-1])
        fused = fused_loss_on(cfg, on_gpu)
        # a layer's working set and the head's are live in different phases of the step: the larger one counts
        self.compiled = runs_compiled(cfg, on_gpu)
        self.compile_workers = compile_workers_on(cfg, on_gpu)
        self.mlp_chunk_tokens = resolve_mlp_chunk_tokens(t.mlp_chunk_tokens, self.mb_tokens)
        self.attention = run_attention(spec, cfg, on_gpu)
        self.act = max(layer_working_bytes(spec, self.mb_tokens, self.compute_bytes, self.compiled,
                                           self.mlp_chunk_tokens, self.attention),
                       loss_activation_bytes(spec, self.mb_tokens, self.compute_bytes, fused))
        flops = model_flops_per_token(cfg.model, t.seq_len)
        self.layer_fwd_flops = flops["layer_forward_flops_per_token"] * self.step_tokens
        self.layer_attn_fwd_flops = flops["layer_attention_forward_flops_per_token"] * self.step_tokens
        # a chunked MLP checkpoints each chunk: a layer's backward runs its MLP forward once more
        chunked = mlp_chunked(self.mlp_chunk_tokens, self.mb_tokens)
        self.mlp_recompute_flops = flops["layer_mlp_forward_flops_per_token"] * self.step_tokens if chunked else 0
        # the streaming engine's recompute leaves out what no gradient reads (ModelSpec.layer_grads)
        self.recompute_skipped_flops = spec.recompute_skipped_flops_per_token(chunked) * self.step_tokens
        # the head: forward + backward (2x); the chunked torch chain also recomputes the logits in its backward
        self.head_flops = (3 if fused else 4) * flops["head_forward_flops_per_token"] * self.step_tokens

    @property
    def kept_graph_bytes(self) -> int:
        """What one layer's kept autograd graph holds for all micro-batches (the tensors the recompute would
        rebuild), plus the layer's own slot."""
        per_micro_batch = layer_graph_bytes(self.spec, self.mb_tokens, self.compute_bytes, self.compiled,
                                            self.mlp_chunk_tokens)
        return per_micro_batch * (self.step_tokens // self.mb_tokens) + self.slot_bytes(self.layouts[1])

    def slot_bytes(self, lay) -> int:
        return self.compute_bytes * lay.cast_numel + 4 * (lay.numel - lay.cast_numel)

    def own_slot_bytes(self, n_res: int) -> int:
        """The slots of their own that the GPU-resident layers take when weights are not cached."""
        return sum(self.slot_bytes(self.layouts[u]) for u in range(1, min(n_res, self.L + 1)))

    def own_accumulator_bytes(self, n_gpu_updated: int) -> int:
        """The gradients of their own that the GPU-updated layers hold on the GPU when gradients go to the host (fp32:
        the accumulator itself; bf16: the rounded copy, the accumulator being one of the shared ones, and the
        embedding's and head's rounded copies too)."""
        held = list(range(1, min(n_gpu_updated, self.L + 1)))
        if self.fmt.grad != "fp32":
            held += [u for u in (0, self.L + 1) if u < n_gpu_updated]
        return self.fmt.grad_bytes(sum(self.layouts[u].numel for u in held))

    def transfer_bytes(self, numel: int) -> int:
        """A host-updated unit's gradient over D2H and in host memory: fp32, or bf16 with bf16 transfer."""
        return (2 if self.grad_transfer == "bf16" else 4) * numel

    def staging_bytes(self, n_res: int, n_str: int) -> int:
        """The GPU staging buffers of the streamed units' state (engine/streaming/streamed_update.py)."""
        from engine.streaming.streamed_update import N_STAGES

        if not n_str:
            return 0
        return min(N_STAGES, n_str) * self.fmt.state_bytes(max(lay.numel for lay in self.layouts[n_res:n_res + n_str]))


def _reference(spec, cfg, gpu_gib, host_gib, on_gpu, fmt: StateFormat) -> MemoryPlan:
    t, hw = cfg.train, cfg.hardware
    s = _Shape(spec, cfg, on_gpu, fmt)
    n = spec.num_params()
    tier = "gpu" if on_gpu else "host"
    plan = MemoryPlan(engine="reference", limits_gib={"gpu": gpu_gib if on_gpu else 0.0, "host": host_gib})
    plan.add(tier, f"{fmt.master} master weights", fmt.master_bytes(n))
    plan.add(tier, "fp32 gradients", 4 * n)
    plan.add(tier, f"{fmt.moments} Adam m + v", fmt.moments_bytes(n))
    if not fmt.torch_adamw(t.fp32_update):  # the kernel's path (engine/reference.py)
        plan.add(tier, "fp32 weights the forward reads, the gathered fp32 gradient (+ its bf16 copy)",
                 8 * n + (fmt.grad_bytes(n) if fmt.grad != "fp32" else 0))
    plan.add(tier, "layer-input activations (one micro-batch)",
             (s.L if t.activation_checkpointing else 0) * 4 * s.h * s.mb_tokens)
    plan.add(tier, "working activations (one layer, or the loss chunk)",
             s.act * (1 if t.activation_checkpointing else s.L))
    add_process_row(plan, hw, s.compile_workers)
    sp = Speeds(hw, runs_compiled(cfg, on_gpu), s.attention, spec.moe, spec.arch.hidden)
    if on_gpu and sp.known:
        recompute = 1 if t.activation_checkpointing else 0
        plan.times_s = {"forward": s.L * sp.layer_fwd_s(s), "head": s.head_flops / sp.head,
                        "backward": s.L * sp.layer_bwd_s(s, 2 + recompute),
                        "optimizer": fmt.update_hbm_bytes(n) / HBM_ADAMW_BYTES_PER_S}
        plan.times_s["step"] = sum(plan.times_s.values()) + STEP_OVERHEAD_S
        plan.binding = "GPU compute"
        plan.speeds = sp.describe(hw)
    return plan


class Speeds:
    """The profile's calibrated figures (bench/calibrate.py) for the mode the run executes in: compiled templates or
    eager. `known` is false when the profile has none for that mode (no time prediction, no split search).

    A layer's time is its attention FLOPs at the attention rates plus its other FLOPs at the layer rates when the
    profile has attention figures; without them the layer rates time all of it, which is right only near the
    calibration's length (qwen7b's attention is 5% of its FLOPs at 4K tokens per sequence, a third at 32K, 88% at
    512K; one rate fitted at 4K made the 32K step 17% short on an H200). `attention`: the run's backend, named in
    `describe` when it is not the one the attention figures were measured with. `moe`: the model's layers are MoE
    layers, timed with the profile's MoE figures where it has them."""

    def __init__(self, hw, compiled: bool, attention: str = "", moe: bool = False, hidden: int = 0):
        mode = "compiled" if compiled else "eager"
        self.mode = mode
        rates, self.width_note = width_rates(hw, mode, hidden)
        self.fwd, self.bwd, self.head = (r * 1e12 for r in rates)
        # a MoE model's layers at the figures of a measured MoE layer where the profile has them
        self.moe, self.moe_calibrated = moe, moe and hw[f"moe_fwd_tflops_{mode}"] > 0
        if self.moe_calibrated:
            self.fwd, self.bwd = (hw[f"moe_{k}_tflops_{mode}"] * 1e12 for k in ("fwd", "bwd"))
        self.attn_calibrated = min(hw.attn_fwd_tflops, hw.attn_bwd_tflops) > 0
        # without attention figures the layer rates time the attention too
        self.attn_fwd, self.attn_bwd = (hw.attn_fwd_tflops * 1e12, hw.attn_bwd_tflops * 1e12) \
            if self.attn_calibrated else (self.fwd, self.bwd)
        self.attention = attention
        self.h2d, self.d2h, self.bidir = hw.h2d_gbps * 1e9, hw.d2h_gbps * 1e9, hw.bidir_gbps * 1e9
        # the link's rate while the host AdamW runs, as a fraction of its rate alone (page-locked DMA and the
        # optimizer share host memory bandwidth); 1 where the profile has no such figure
        self.link_under_adam = min(1.0, hw.bidir_gbps_under_adam / hw.bidir_gbps) \
            if hw.bidir_gbps_under_adam > 0 and hw.bidir_gbps > 0 else 1.0
        # the host AdamW always runs while the forward streams, so its rate under PCIe load is the one used
        self.adam_pcie = hw.cpu_adam_gparams_per_s_under_pcie * 1e9
        self.nvme = hw.nvme_gbps * 1e9  # 0: unknown, the tier's I/O is not timed
        self.known = min(self.fwd, self.bwd, self.head) > 0

    def layer_fwd_s(self, s: "_Shape", forwards: int = 1) -> float:
        """Seconds of `forwards` forwards of one layer over the step's tokens, run without autograd."""
        other = s.layer_fwd_flops - s.layer_attn_fwd_flops
        return forwards * (other / self.fwd + s.layer_attn_fwd_flops / self.attn_fwd)

    def layer_bwd_s(self, s: "_Shape", forwards: int, skipped_flops: float = 0.0) -> float:
        """Seconds of one layer's backward work worth `forwards` forwards of FLOPs (3: a forward with autograd, then
        the backward's two; 2 for a kept graph) less `skipped_flops` of its recompute, at the backward rates, plus a
        chunked MLP's recompute of its checkpointed chunks (one MLP forward, at the forward rate)."""
        other = forwards * (s.layer_fwd_flops - s.layer_attn_fwd_flops) - skipped_flops
        return other / self.bwd + forwards * s.layer_attn_fwd_flops / self.attn_bwd + s.mlp_recompute_flops / self.fwd

    def describe(self, hw) -> str:
        line = f"speeds: the {self.mode} figures of hardware={hw.name}; calibration: {hw.calibration or 'none'}"
        if self.width_note:
            line += f"; {self.width_note}"
        if not self.attn_calibrated:
            line += "; attention timed at the layer's rate (no attention figures)"
        else:
            line += f"; attention at its own rates ({hw.attn_backend}, measured at {hw.attn_seq_len} tokens)"
            if self.attention and self.attention != hw.attn_backend:
                line += f", but this run's attention is {self.attention}"
        if self.moe_calibrated:
            line += f"; MoE layers at the figures of a {hw.moe_model} layer"
        elif self.moe:  # the grouped expert matmuls and their gather / scatter run well below a dense layer's rate
            line += ("; MoE layers are timed at a dense layer's figures (the profile has no MoE figures: "
                     "bench/calibrate.py --moe-model): expect a longer step, the backward most")
        return line


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
    named = ", ".join(f"{h} ({m})" for h, m, _ in points)
    below = [p for p in points if p[0] <= hidden]
    above = [p for p in points if p[0] >= hidden]
    if not below or not above:
        h, m, rates = above[0] if above else below[-1]
        return rates, (f"layers at the figures of the nearest calibrated width, {h} ({m}); this model's {hidden} is "
                       f"outside the calibrated widths {named}")
    (h0, m0, r0), (h1, m1, r1) = below[-1], above[0]
    if h0 == h1:
        return r0, f"layers at the figures of calibrated width {h0} ({m0})"
    t = math.log(hidden / h0) / math.log(h1 / h0)
    rates = tuple(a + t * (b - a) for a, b in zip(r0, r1))
    return rates, (f"layers at rates interpolated for width {hidden} between calibrated widths {h0} ({m0}) and "
                   f"{h1} ({m1})")


def run_attention(spec, cfg, on_gpu: bool) -> str:
    """The attention backend the run will resolve to (engine/model/attention.py), or the asked-for name when it
    cannot run here (the trainer refuses that run; a plan still prints)."""
    try:
        return resolve_attention(cfg.train.attention, "cuda" if on_gpu else "cpu", spec.arch.head_dim,
                                 spec.sinks_or_window)
    except ConfigError:
        return cfg.train.attention


def process_host_bytes(hw, compile_workers: bool) -> int:
    """The training process's host memory before any state: the calibrated figure, without torch.compile's worker
    processes when the run starts none (no compiled templates, or `train.compile_in_process`; on an H100 host they
    are 7.3-7.7 of its 9-10 GiB)."""
    return int(max(0.0, hw.host_process_gib - (0.0 if compile_workers else hw.host_compile_workers_gib)) * GIB)


def add_process_row(plan: MemoryPlan, hw, compile_workers: bool) -> int:
    """The host row of the process itself (none when the profile has no figure); returns its bytes."""
    nbytes = process_host_bytes(hw, compile_workers)
    if nbytes:
        workers = "" if compile_workers else ", no compile workers"
        plan.add("host", f"this process: torch, CUDA context, compiled kernels (calibrated{workers})", nbytes)
    return nbytes


def compile_workers_on(cfg, on_gpu: bool) -> bool:
    """Whether the run starts Inductor's compile worker pool: compiled templates, not built in this process."""
    return runs_compiled(cfg, on_gpu) and not cfg.train.compile_in_process


def runs_compiled(cfg, on_gpu: bool) -> bool:
    """Whether the templates will be torch.compiled (engine/trainer.py decides the same way)."""
    return cfg.train.compile == "on" or (cfg.train.compile == "auto" and on_gpu)


def fused_loss_on(cfg, on_gpu: bool) -> bool:
    """Whether the head runs the fused LM head + cross-entropy: `train.fused_loss=auto` is on with CUDA (on a CPU
    the Triton kernel runs only under the interpreter, the tests' business)."""
    return cfg.train.fused_loss == "on" or (cfg.train.fused_loss == "auto" and on_gpu)


def predict_stream(s: _Shape, sp: Speeds, placement: dict) -> Tuple[Dict[str, float], str]:
    """(phase times, binding resource) of one streamed step under `placement`.

    Forward: a pipeline of four resources (H2D, D2H, host AdamW, compute) in unit order. The H2D stream brings unit
    u in (nothing for a GPU-resident unit, its fp32 master for a host-updated one, master + m + v for a GPU-streamed
    one, whose state also goes back over D2H; both directions then share the link's bidirectional rate); a load
    starts once the host AdamW has updated the unit, its slot is free (the ring holds `slots` units) and, for a
    streamed unit, its staging buffer is free (two buffers, freed by the D2H). Compute runs each unit when its
    weights are in. The host AdamW updates its units in order from the start of the forward, at its rate under PCIe
    load; a transfer that starts while it runs moves at the link's rate under the optimizer (`bidir_gbps_under_adam`
    over `bidir_gbps`, in both directions: of qwen7b's forward wait at 64K tokens that the plan missed, this accounts
    for half on an H100 and most on an H200, `bench/plan_backtest.py`). Exposed wait: forward time beyond its
    compute. Backward: per layer the larger of its compute and its transfers; the backward reaches a recompute
    group at its last layer, which also regenerates the group (the forward of its other layers, their weights loaded
    again, the kept input brought in). The binding resource has the most busy time.

    Sharded state (`s.state_ranks` > 1, engine/distributed.py): a unit's host update, its H2D and its gradient's D2H
    run on its owner's CPU and link, so each rank's AdamW clock and link are pipelines of their own (the ring's
    slots bound how many loads are in flight). The backward is the larger of its compute and the busiest link's
    transfers. Not modelled: the NVLink traffic (each slot's broadcast and each gradient's reduce, at several times
    the PCIe rate, on a stream of their own)."""
    n_res, n_str = placement["gpu_resident_units"], placement["gpu_streamed_units"]
    cached = placement["cache_weights"] == "on"
    grads_host = placement["grads_tier"] == "host"
    activations_host = placement["activation_tier"] == "host"
    n_units = len(s.layouts)
    numel = [lay.numel for lay in s.layouts]
    place = ["resident" if u < n_res else "streamed" if u < n_res + n_str else "host" for u in range(n_units)]
    link_each = min(sp.h2d, sp.d2h, sp.bidir / 2)  # each direction's rate while both stream
    layer_input_bytes = 4 * s.h * s.step_tokens  # one layer's kept inputs, all micro-batches
    compute = [sp.layer_fwd_s(s) if 1 <= u <= s.L else 0.0 for u in range(n_units)]
    first_kept = s.L - placement.get("keep_activation_layers", 0) + 1  # layers from here on keep their graphs
    g = placement["recompute_group"]
    kept_inputs = kept_layer_inputs(s.L, s.L + 1 - first_kept, g)

    from engine.streaming.nvme import file_bytes as nvme_file_bytes, nvme_layers

    on_disk = set(nvme_layers(n_units, n_res + n_str, placement.get("nvme_units", 0)))

    def host_update_s(u: int) -> float:
        """The host AdamW of unit u; for a unit in the NVMe tier, the longer of that and its moments' I/O."""
        adam = numel[u] / sp.adam_pcie
        return max(adam, 2 * nvme_file_bytes([numel[u]]) / sp.nvme) if u in on_disk and sp.nvme else adam

    ranks = s.state_ranks
    owner = state_owners(s.spec, n_res, ranks) if ranks > 1 else {}
    link = [owner.get(u, 0) for u in range(n_units)]  # whose CPU updates and whose link carries unit u

    host_done, clock = [0.0] * n_units, [0.0] * ranks
    for u in range(n_units):
        if place[u] == "host":
            clock[link[u]] += host_update_s(u)
        host_done[u] = clock[link[u]]
    slots = n_units if cached else placement.get("slots", 2)
    h2d_end, d2h_end, end = [0.0] * n_units, [0.0] * n_units, [0.0] * n_units
    h2d_prev, d2h_prev, end_prev = [0.0] * ranks, [0.0] * ranks, 0.0
    h2d_busy, d2h_busy = [0.0] * ranks, [0.0] * ranks

    def slowdown(t: float, r: int) -> float:
        """1 / the link's rate factor for a transfer of rank r's link starting at t (slower while its AdamW runs)."""
        return 1.0 / sp.link_under_adam if t < clock[r] else 1.0

    for u in range(n_units):
        r = link[u]
        start = max(h2d_prev[r], host_done[u])
        if 1 <= u <= s.L and u - slots >= 1:
            start = max(start, end[u - slots])
        if place[u] == "streamed":
            if u - 2 >= n_res:
                start = max(start, d2h_end[u - 2])
            h2d_t = s.fmt.state_bytes(numel[u]) / link_each
        else:
            h2d_t = 0.0 if place[u] == "resident" else s.fmt.master_bytes(numel[u]) / sp.h2d
        h2d_t *= slowdown(start, r)
        h2d_end[u] = h2d_prev[r] = start + h2d_t
        d2h_t = s.fmt.state_bytes(numel[u]) / link_each if place[u] == "streamed" else 0.0
        d2h_t *= slowdown(max(d2h_prev[r], h2d_end[u]), r)
        # each rank's kept activations go out over its own link
        act_t = layer_input_bytes / sp.d2h if activations_host and 1 <= u and u - 1 in kept_inputs else 0.0
        for q in range(ranks):
            d2h_prev[q] = max(d2h_prev[q], h2d_end[u]) + act_t + (d2h_t if q == r else 0.0)
            d2h_busy[q] += act_t + (d2h_t if q == r else 0.0)
        d2h_end[u] = d2h_prev[r]
        h2d_busy[r] += h2d_t
        end[u] = end_prev = max(end_prev, h2d_end[u]) + compute[u]
    t_fwd = end[-1]
    exposed = t_fwd - sum(compute)
    fwd_h2d, fwd_d2h = max(h2d_busy), max(d2h_busy)
    head = s.head_flops / sp.head
    backward = 0.0

    def weights_in(u: int) -> float:
        return 0.0 if cached or place[u] == "resident" else s.fmt.master_bytes(numel[u]) / sp.h2d

    bwd_compute, bwd_h2d, bwd_d2h = 0.0, [0.0] * ranks, [0.0] * ranks
    for u in range(1, s.L + 1):
        kept = u >= first_kept  # its graph was kept: no recompute, no reload of its weights or inputs
        layer_compute = sp.layer_bwd_s(s, 2) if kept else sp.layer_bwd_s(s, 3, s.recompute_skipped_flops)
        h2d = [0.0] * ranks
        h2d[link[u]] = 0.0 if kept else weights_in(u)
        if not kept and (u % g == 0 or u == first_kept - 1):  # the last layer of its group: regenerate the group
            others = range(u - (u - 1) % g, u)  # the layers from the one reading the kept input up to u - 1
            layer_compute += sp.layer_fwd_s(s, len(others))
            for v in others:
                h2d[link[v]] += weights_in(v)
            for q in range(ranks):
                h2d[q] += layer_input_bytes / sp.h2d if activations_host else 0.0
        grad_out = s.transfer_bytes(numel[u]) / sp.d2h if grads_host and place[u] == "host" else 0.0
        backward += max(layer_compute, max(h2d), grad_out)
        bwd_compute += layer_compute
        for q in range(ranks):
            bwd_h2d[q] += h2d[q]
        bwd_d2h[link[u]] += grad_out
    if ranks > 1:  # the ranks' links work side by side: the busiest one, or the compute, sets the pace
        backward = max(bwd_compute, max(bwd_h2d), max(bwd_d2h))
    h2d_busy = [a + b for a, b in zip(h2d_busy, bwd_h2d)]
    d2h_busy = [a + b for a, b in zip(d2h_busy, bwd_d2h)]
    resident_adam = s.fmt.update_hbm_bytes(sum(numel[:n_res])) / HBM_ADAMW_BYTES_PER_S
    host_total = max(clock)  # the busiest rank's host AdamW
    times = {"forward": t_fwd, "forward_compute": sum(compute), "forward_h2d": fwd_h2d, "forward_d2h": fwd_d2h,
             "head": head, "backward": backward, "gpu_resident_adamw": resident_adam, "host_adamw": host_total,
             "exposed_wait": exposed}
    times["step"] = t_fwd + head + backward + resident_adam + STEP_OVERHEAD_S
    busy_by = {"GPU compute": sum(compute) + head + backward, "H2D": max(h2d_busy), "D2H": max(d2h_busy),
               "host AdamW" if not on_disk else "host AdamW + NVMe": host_total}
    return times, max(busy_by, key=busy_by.get)


def _placements(s: _Shape, e, n_kept: int, g: int, splits, fixed_split: bool, nbytes: Dict[str, float]):
    """([(placement, free GPU bytes)] of every split that fits with `n_kept` kept graphs and recompute groups of
    `g`, the forced placement of the first split). HBM left after the fixed working set is spent in the module
    docstring's order."""
    free = nbytes["free"]
    host_free = nbytes["host_free"]
    placement: Dict[str, object] = {"slots": min(e.slots, s.L), "keep_activation_layers": n_kept,
                                    "recompute_group": g}

    def place(key: str, extra_gpu_bytes: float, forced: str) -> bool:
        nonlocal free
        on = forced == "gpu" or (forced == "auto" and extra_gpu_bytes <= free)
        if on:
            free -= extra_gpu_bytes
        placement[key] = "gpu" if on else "host"
        return on

    if not place("activation_tier", nbytes["activation"], e.activation_tier):
        host_free -= nbytes["activation"]
    # the host cannot hold them (or the config says gpu): they outrank everything below
    grads_first = nbytes["grad"] > host_free or e.grads_tier == "gpu"
    if grads_first:
        place("grads_tier", nbytes["grad"] - nbytes["side_grad"], e.grads_tier)
    placement.setdefault("grads_tier", "host")
    base, free_base = dict(placement), free

    def complete(n_res: int, n_str: int, force: bool = False) -> Optional[Tuple[dict, float]]:
        """The placement with this split and the rest of HBM spent (weights cached, gradients), or None when the
        split does not fit (unless `force`: the config fixed it, or nothing fits and the plan will say so)."""
        nonlocal free
        placement.clear()
        placement.update(base, cache_weights="on" if e.cache_weights == "on" else "off",
                         gpu_resident_units=n_res, gpu_streamed_units=n_str)
        free = free_base - _split_bytes(s, n_res, n_str, base["grads_tier"] == "gpu",
                                        placement["cache_weights"] == "on")
        if free < 0 and not force:
            return None
        if e.cache_weights != "on":
            cache_on = place("cache_weights", nbytes["cache"] - nbytes["ring"] - s.own_slot_bytes(n_res),
                             {"on": "gpu", "off": "host"}.get(e.cache_weights, "auto"))
            placement["cache_weights"] = "on" if cache_on else "off"
        if not grads_first:
            place("grads_tier", nbytes["grad"] - nbytes["side_grad"] - s.own_accumulator_bytes(n_res + n_str),
                  e.grads_tier)
        return dict(placement), free

    found = [c for c in (complete(*split, force=fixed_split) for split in splits) if c is not None]
    return found, complete(*splits[0], force=True)[0]


def _split_bytes(s: _Shape, n_res: int, n_str: int, grads_on_gpu: bool, cached: bool) -> int:
    """GPU bytes the update places take beyond the fixed working set: resident state (+ the resident layers' own
    slots and accumulators), streamed staging (+ the streamed layers' accumulators)."""
    nbytes = sum(s.fmt.state_bytes(lay.numel) for lay in s.layouts[:n_res]) + s.staging_bytes(n_res, n_str)
    if not grads_on_gpu:
        nbytes += s.own_accumulator_bytes(n_res + n_str)
    if not cached:
        nbytes += s.own_slot_bytes(n_res)
    return nbytes


def choose_split(s: _Shape, sp: Speeds, candidates: List[Tuple[dict, float]]) -> Optional[Tuple[dict, float]]:
    """The fastest predicted of the (placement, free GPU bytes) candidates. Among those within 1% of the fastest,
    the one with the most slack: the least busy of its forward's non-compute resources (host AdamW, H2D, D2H)
    relative to the forward's compute, so that an error in a calibrated rate costs the least."""
    if not candidates or not sp.known:
        return candidates[0] if candidates else None
    scored = []
    for placement, free in candidates:
        times, _ = predict_stream(s, sp, placement)
        load = max(times["host_adamw"], times["forward_h2d"], times["forward_d2h"]) / times["forward_compute"]
        scored.append((times["step"], load, -free, placement, free))
    best = min(c[0] for c in scored)
    chosen = min((c for c in scored if c[0] <= 1.01 * best), key=lambda c: (c[1], c[2]))
    return chosen[3], chosen[4]


def _stream(spec, cfg, gpu_gib, host_gib, on_gpu, fmt: StateFormat, state_ranks: int = 1) -> MemoryPlan:
    e, hw = cfg.engine, cfg.hardware
    s = _Shape(spec, cfg, on_gpu, fmt, state_ranks)
    sp = Speeds(hw, runs_compiled(cfg, on_gpu), s.attention, spec.moe, spec.arch.hidden)
    layouts, L = s.layouts, s.L
    compute_tier = "gpu" if on_gpu else "host"

    from engine.streaming.host_store import init_copies
    from engine.streaming.nvme import STAGING_BUFFERS, nvme_layers
    from engine.streaming.nvme import file_bytes as nvme_file_bytes
    from engine.streaming.slots import STAGING_ELEMS

    ring_bytes = min(e.slots, L) * (s.compute_bytes * s.layer_cast + 4 * (s.layer_numel - s.layer_cast))
    side_grad_bytes = 4 * (layouts[0].numel + layouts[-1].numel + min(2, L) * s.layer_numel)
    # held gradients of every unit on the GPU: fp32 ones are the accumulators themselves; bf16 ones are rounded
    # copies, the shared accumulators (side_grad_bytes) staying as the working set
    grad_bytes = fmt.grad_bytes(sum(lay.numel for lay in layouts)) + (0 if fmt.grad == "fp32" else side_grad_bytes)
    cache_bytes = sum(s.slot_bytes(lay) for lay in layouts[1:-1])
    margin_gib = 2.0 + 0.05 * gpu_gib if on_gpu else 0.0
    state_bytes = [fmt.state_bytes(lay.numel) for lay in layouts]  # master + m + v in their formats
    state_name = f"{fmt.master} master, {fmt.moments} Adam m + v"

    def fixed_rows(n_kept: int) -> List[Tuple[str, int]]:
        return [
            ("H2D staging buffer (fp32)", 4 * min(STAGING_ELEMS, max(lay.cast_numel for lay in layouts))),
            ("embedding + head slots", s.slot_bytes(layouts[0]) + s.slot_bytes(layouts[-1])),
            ("residual stream + its gradient, all micro-batches", 2 * 4 * s.h * s.step_tokens),
            ("working activations (one layer, or the loss chunk)", s.act),
            (f"autograd graphs of the last {n_kept} layers (no recompute)", n_kept * s.kept_graph_bytes),
        ]

    def activation_bytes(n_kept: int, g: int) -> int:
        """The kept inputs of the recomputed layers (kept layers' inputs live in their graphs)."""
        return len(kept_layer_inputs(L, n_kept, g)) * 4 * s.h * s.step_tokens

    def regenerated_bytes(n_kept: int, g: int) -> int:
        """One recompute group's regenerated inputs, held on the GPU during its backward."""
        return min(g, L - n_kept) * 4 * s.h * s.step_tokens if g > 1 else 0

    def rows_for(placement: Dict[str, object]) -> MemoryPlan:
        """The memory plan of one placement: every row, both tiers."""
        plan = MemoryPlan(engine="stream", limits_gib={"gpu": gpu_gib if on_gpu else 0.0, "host": host_gib,
                                                       "nvme": hw.nvme_gib if hw.nvme_dir else 0.0})
        plan.placement = placement
        n_kept, g = placement["keep_activation_layers"], placement["recompute_group"]
        n_res, n_str = placement["gpu_resident_units"], placement["gpu_streamed_units"]
        n_host = len(layouts) - n_res - n_str
        grads_on_gpu = placement["grads_tier"] == "gpu"
        cached = placement["cache_weights"] == "on"
        held = held_units(n_res)
        disk = [u for u in disk_units(placement) if u in held]
        shard = f", this rank's {len(held)} of them" if state_ranks > 1 else ""
        plan.add("host", f"{state_name}: {n_str} GPU-streamed + {n_host} host-updated units{shard}"
                 + (f" ({len(disk)} of them master only)" if disk else ""),
                 sum(state_bytes[u] for u in held) - sum(moment_bytes[u] for u in disk))
        if disk:
            plan.add("nvme", f"Adam m + v of the last {len(disk)} host-updated layers (a file in hardware.nvme_dir)",
                     nvme_file_bytes([layouts[u].numel for u in disk]))
            plan.add("host", f"NVMe tier staging ({STAGING_BUFFERS} x the largest such unit's m + v)",
                     STAGING_BUFFERS * nvme_file_bytes([max(layouts[u].numel for u in disk)]))
        for item, nbytes in fixed_rows(n_kept):
            plan.add(compute_tier, item, nbytes)
        if n_res:
            plan.add(compute_tier, f"{state_name}: {n_res} leading units resident, updated on the GPU",
                     sum(state_bytes[:n_res]))
        if n_str:
            plan.add(compute_tier, f"staging for GPU-streamed updates (state of the largest of {n_str} units, x2)",
                     s.staging_bytes(n_res, n_str))
        plan.add(compute_tier if placement["activation_tier"] == "gpu" else "host",
                 "layer-input activations (all micro-batches)", activation_bytes(n_kept, g))
        if g > 1:
            plan.add(compute_tier, f"regenerated layer inputs (one group of {g}, all micro-batches)",
                     regenerated_bytes(n_kept, g))
        largest_host = max([lay.numel for lay in layouts[n_res + n_str:]], default=0)
        if grads_on_gpu:
            plan.add(compute_tier, f"{fmt.grad} gradients of every unit until the norm is known", grad_bytes)
            if n_host:
                plan.add("host", f"pinned gradient staging ({s.grad_transfer}, 2 x largest host-updated unit)",
                         2 * s.transfer_bytes(largest_host))
        else:
            plan.add("host", f"{s.grad_transfer} gradients of host-updated units until the global norm is known",
                     s.transfer_bytes(sum(layouts[u].numel for u in held if u >= n_res + n_str)))
            plan.add(compute_tier, f"accumulators: embedding, head, 2 layers (fp32); GPU-updated layers ({fmt.grad})",
                     side_grad_bytes + s.own_accumulator_bytes(n_res + n_str))
        if n_host and s.grad_transfer == "bf16":
            # the bf16 copies the D2H reads: of the accumulators that serve host-updated units (the head, the
            # embedding when it is host-updated, the shared pair of layers when a layer is), or the fetch's pair
            n_gpu = n_res + n_str
            wired = 2 * largest_host if grads_on_gpu else (layouts[-1].numel + (layouts[0].numel if n_gpu == 0 else 0)
                                                           + (min(2, L) * s.layer_numel if n_gpu <= L else 0))
            plan.add(compute_tier, "bf16 copies of host-updated units' gradients for the D2H (stochastic rounding)",
                     2 * wired)
            plan.add("host", "fp32 scratch the host AdamW upcasts each bf16 gradient into (largest host-updated unit)",
                     4 * largest_host)
        if cached:
            plan.add(compute_tier, "layer slots: one per layer (weights cached fwd -> bwd)", cache_bytes)
        else:
            plan.add(compute_tier, f"layer slots: ring of {min(e.slots, L)} (+ one per GPU-resident layer)",
                     ring_bytes + s.own_slot_bytes(n_res))
        if on_gpu:
            plan.reserve("gpu", "allocator margin + CUDA context (reserved, not allocated)", int(margin_gib * GIB))
        process_bytes = add_process_row(plan, hw, s.compile_workers)
        # start-up: the host masters are written while the other host buffers are not yet touched, but with a
        # low-precision master each unit being initialised also holds an fp32 copy (HostStore); the plan's host
        # figure is the larger of the two
        held_numels = [layouts[u].numel for u in held]
        copies = init_copies(fmt.master, held_numels)
        startup = (sum(fmt.master_bytes(n) for n in held_numels) + copies * 4 * max(held_numels, default=0)
                   + process_bytes)
        if startup > plan.total("host"):
            plan.add("host", f"start-up peak above the rest: fp32 copies of the {copies} units initialised at once "
                     f"({fmt.master} master)", startup - plan.total("host"))
        return plan

    n_units = len(layouts)
    moment_bytes = [fmt.state_bytes(lay.numel) - fmt.master_bytes(lay.numel) for lay in layouts]

    def held_units(n_res: int) -> set:
        """The host-state units of the rank that holds the most of them (all of them on one rank)."""
        if state_ranks <= 1:
            return set(range(n_res, n_units))
        owner = state_owners(spec, n_res, state_ranks)
        per_rank = [{u for u, r in owner.items() if r == rank} for rank in range(state_ranks)]
        return max(per_rank, key=lambda units: sum(state_bytes[u] for u in units))
    nvme_on = bool(hw.nvme_dir) and hw.nvme_gib > 0 and fmt.exact

    def disk_units(placement: Dict[str, object]) -> List[int]:
        """The units whose moments the placement puts in the NVMe tier: its last `nvme_units` host-updated layers."""
        return nvme_layers(n_units, placement["gpu_resident_units"] + placement["gpu_streamed_units"],
                           placement.get("nvme_units", 0))

    def with_nvme(placement: Dict[str, object]) -> Dict[str, object]:
        """`placement` with its `nvme_units`: the configured count, or (-1) the fewest host-updated units, last
        first, whose moments on disk make the host fit, within hardware.nvme_gib."""
        host_layers = len(nvme_layers(n_units, placement["gpu_resident_units"] + placement["gpu_streamed_units"],
                                      n_units))
        if e.nvme_units >= 0 or not nvme_on:
            placement["nvme_units"] = max(0, e.nvme_units)
            return placement
        placement["nvme_units"] = 0
        best, best_host = 0, rows_for(placement).total("host")
        for n in range(1, host_layers + 1):  # the staging buffers cost host memory too: keep the n that saves most
            if best_host <= host_gib * GIB:
                break
            if nvme_file_bytes([layouts[u].numel for u in range(L + 1 - n, L + 1)]) > hw.nvme_gib * GIB:
                break
            placement["nvme_units"] = n
            host = rows_for(placement).total("host")
            if host < best_host:
                best, best_host = n, host
        placement["nvme_units"] = best
        return placement

    # the host AdamW updates fp32 state only: a low-precision format puts every unit on the GPU for its update
    gpu_updated_only = not fmt.exact
    if gpu_updated_only and e.gpu_resident_units >= 0 and e.gpu_streamed_units >= 0 \
            and e.gpu_resident_units + e.gpu_streamed_units < n_units:
        raise PlanError(f"{fmt.overrides()} is updated on the GPU only (the host AdamW runs fp32 state), but "
                        f"engine.gpu_resident_units={e.gpu_resident_units} + engine.gpu_streamed_units="
                        f"{e.gpu_streamed_units} leave {n_units - e.gpu_resident_units - e.gpu_streamed_units} of "
                        f"the {n_units} units (embedding, {L} layers, head) to it; make them add up to {n_units}, "
                        "or leave one of them at -1 (auto)")

    def streamed_default(n_res: int) -> int:
        return e.gpu_streamed_units if e.gpu_streamed_units >= 0 else (n_units - n_res if gpu_updated_only else 0)

    unfit_note = ""
    if not on_gpu:  # one memory: explicit choices are honoured so CPU runs exercise every code path
        placement: Dict[str, object] = {
            "slots": min(e.slots, L), "keep_activation_layers": max(0, e.keep_activation_layers),
            "recompute_group": max(1, e.recompute_group),
            "activation_tier": "gpu" if e.activation_tier == "gpu" else "host",
            "grads_tier": "gpu" if e.grads_tier == "gpu" else "host",
            "cache_weights": "on" if e.cache_weights == "on" else "off",
            # a low-precision format with nothing fixed: every unit resident
            "gpu_resident_units": n_units if gpu_updated_only and e.gpu_resident_units < 0
            and e.gpu_streamed_units < 0 else max(0, e.gpu_resident_units)}
        placement["gpu_streamed_units"] = streamed_default(placement["gpu_resident_units"])
        with_nvme(placement)
    else:
        splits = [(r, t) for r in ([min(e.gpu_resident_units, n_units)] if e.gpu_resident_units >= 0
                                   else range(n_units + 1))
                  for t in ([min(e.gpu_streamed_units, n_units - r)] if e.gpu_streamed_units >= 0
                            else range(n_units - r + 1))
                  if not gpu_updated_only or r + t == n_units]
        kept_choices = [e.keep_activation_layers] if e.keep_activation_layers >= 0 else range(L + 1)
        if not sp.known:  # no speeds to choose by: what the config fixes, else every update on the host
            splits = [(max(0, e.gpu_resident_units), streamed_default(max(0, e.gpu_resident_units)))]
            kept_choices = [max(0, e.keep_activation_layers)]
        fixed_split = e.gpu_resident_units >= 0 and e.gpu_streamed_units >= 0

        fixed_bytes = {n_kept: sum(b for _, b in fixed_rows(n_kept)) for n_kept in kept_choices}

        def hbm_left(n_kept: int, g: int) -> float:
            """GPU bytes beyond the fixed working set, the layer ring, the shared accumulators and the margin."""
            return (gpu_gib * GIB - fixed_bytes[n_kept] - ring_bytes - side_grad_bytes - margin_gib * GIB
                    - regenerated_bytes(n_kept, g))

        def search(g: int) -> Tuple[list, dict, list]:
            """(every candidate placement with recompute groups of `g`, the forced placement of the first split,
            the candidates that fit both tiers)."""
            candidates, fallback = [], None
            for n_kept in kept_choices:
                found = _placements(s, e, n_kept, g, splits, fixed_split, {
                    "free": hbm_left(n_kept, g),
                    "host_free": host_gib * GIB - sum(state_bytes) - 2 * GIB + nvme_room,
                    "activation": activation_bytes(n_kept, g), "grad": grad_bytes, "side_grad": side_grad_bytes,
                    "cache": cache_bytes, "ring": ring_bytes})
                if fallback is None:
                    fallback = found[1]
                candidates += found[0]
                if not found[0] and e.keep_activation_layers < 0:
                    break  # more kept graphs fit no better
            for placement, _ in candidates:
                with_nvme(placement)
            with_nvme(fallback)
            return candidates, fallback, [c for c in candidates if not rows_for(c[0]).problem()]

        # the process, the state and every gradient but the embedding's, the head's and two layers' (those are in
        # the shared accumulators), whichever tier holds them
        # the most host memory the NVMe tier could take over: every unit's moments, within its disk budget
        nvme_room = min(hw.nvme_gib * GIB, sum(moment_bytes)) if nvme_on else 0
        held_anyway = process_host_bytes(hw, s.compile_workers) + sum(state_bytes) - nvme_room + fmt.grad_bytes(
            sum(lay.numel for lay in layouts[1:-1]) - min(2, L) * s.layer_numel)

        def may_fit(g: int) -> bool:
            """A necessary condition for groups of `g` to fit, cheap beside `search`: for some kept-graph count, HBM
            holds the working set and the host holds what of the state, kept inputs and gradients the rest of HBM
            cannot."""
            for n_kept in kept_choices:
                left = hbm_left(n_kept, g) + ring_bytes - min(ring_bytes, cache_bytes)  # cached slots replace the ring
                if left >= 0 and held_anyway + activation_bytes(n_kept, g) - left <= host_gib * GIB:
                    return True
            return False

        candidates, fallback, fitting = search(max(1, e.recompute_group))
        if e.recompute_group < 0 and not fitting:  # every input kept does not fit: the smallest group that does
            groups = range(2, L - min(kept_choices) + 1)
            for g in groups:
                found = search(g) if may_fit(g) else None
                if found and found[2]:
                    candidates, fallback, fitting = found
                    break
            if not fitting and groups:
                unfit_note = (f"No engine.recompute_group from 2 to {groups[-1]} (recompute groups, one layer input "
                              "kept per group) fits either.")
        chosen = choose_split(s, sp, fitting)
        if chosen is None and candidates:  # nothing fits both tiers: the closest plan, for the refusal to show
            chosen = min(candidates, key=lambda c: rows_for(c[0]).overflow_bytes())
        placement = dict(chosen[0] if chosen else fallback)
    plan = rows_for(placement)
    if unfit_note:
        plan.notes.append(unfit_note)
    if sp.known:
        plan.times_s, plan.binding = predict_stream(s, sp, placement)
        plan.speeds = sp.describe(hw)
    return plan
