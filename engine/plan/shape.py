"""The shape of one step: token counts, unit sizes, FLOPs and the working sets, as the memory rows and the time
model both read them."""

from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, Optional

from engine.distributed import state_owners
from engine.execution import Execution
from engine.formats import StateFormat
from engine.metrics import model_flops_per_token
from engine.model.dense import mlp_chunked
from engine.model.moe import kept_routing_bytes
from engine.plan.activations import layer_graph_bytes, layer_working_bytes, loss_activation_bytes
from engine.streaming.streamed_update import N_STAGES


class StepShape:
    """The numbers both the memory and the time model need, for one run's model, config, state format and
    execution (`execution`: resolved from the config for `on_gpu` when not given)."""

    def __init__(self, spec, cfg, on_gpu: bool, fmt: StateFormat, state_ranks: int = 1,
                 execution: Optional[Execution] = None):
        t = cfg.train
        ex = execution or Execution.of(spec, cfg, on_gpu)
        self.spec = spec
        self.fmt = fmt
        self.state_ranks = state_ranks  # data-parallel ranks the host state is sharded over (engine/distributed.py)
        self.grad_transfer = t.grad_transfer_dtype  # the dtype host-updated units' gradients cross the link in
        self.compute_bytes = 2 if on_gpu and t.compute_dtype != "fp32" else 4
        self.seq_len = t.seq_len  # tokens per sequence: where attention's rate is read
        self.mb_tokens = t.micro_batch_size * t.seq_len
        self.step_tokens = self.mb_tokens * t.grad_accum
        self.h, self.L = spec.arch.hidden, spec.num_layers
        self.layouts = [u.layout for u in spec.units]
        self.layer_numel = max(lay.numel for lay in self.layouts[1:-1])
        self.layer_cast = max(lay.cast_numel for lay in self.layouts[1:-1])
        # sums over the leading units ([k]: units 0..k-1), which the placement search asks of every split it tries;
        # the bytes are ints, so a prefix sum gives what the sum over the units gives
        self.numels = [lay.numel for lay in self.layouts]
        self._numel_upto = list(accumulate(self.numels, initial=0))
        self._slot_upto = list(accumulate((self.slot_bytes(lay) for lay in self.layouts), initial=0))
        self._state_upto = list(accumulate((fmt.state_bytes(n) for n in self.numels), initial=0))
        # held gradients unit by unit, as the engine allocates them (an int8 copy's scales are per unit's blocks)
        self._grad_upto = list(accumulate((fmt.grad_bytes(n) for n in self.numels), initial=0))
        self._owners: Dict[int, Dict[int, int]] = {}  # GPU-resident units -> the host-state units' owners
        self._owned_grad_upto: Dict[int, List[List[int]]] = {}  # the same -> per rank, `_grad_upto` of its own units
        # `staging_bytes` and `split_bytes` by their arguments: the placement search asks for the same splits for
        # every kept-graph count and recompute group
        self._staging: Dict[tuple, int] = {}
        self._split: Dict[tuple, int] = {}
        fused = ex.fused_loss
        self.compiled, self.compile_workers = ex.compiled, ex.compile_workers
        self.mlp_chunk_tokens, self.attention, self.lean = ex.mlp_chunk_tokens, ex.attention, ex.lean
        # a layer's working set and the head's are live in different phases of the step: the larger one counts
        self.act = max(layer_working_bytes(spec, self.mb_tokens, self.compute_bytes, self.compiled,
                                           self.mlp_chunk_tokens, self.attention, self.lean),
                       loss_activation_bytes(spec, self.mb_tokens, self.compute_bytes, fused))
        flops = model_flops_per_token(cfg.model, t.seq_len)
        self.layer_fwd_flops = flops["layer_forward_flops_per_token"] * self.step_tokens
        self.layer_attn_fwd_flops = flops["layer_attention_forward_flops_per_token"] * self.step_tokens
        # a chunked MLP checkpoints each chunk: a layer's backward runs its MLP forward once more (the lean layer
        # rebuilds each chunk once, as its recompute)
        chunked = mlp_chunked(self.mlp_chunk_tokens, self.mb_tokens) and not self.lean
        self.mlp_recompute_flops = flops["layer_mlp_forward_flops_per_token"] * self.step_tokens if chunked else 0
        # the streaming engine's recompute leaves out what no gradient reads (ModelSpec.layer_grads)
        self.recompute_skipped_flops = spec.recompute_skipped_flops_per_token(chunked, self.lean) * self.step_tokens
        # a recomputed MoE layer keeps its forward's routing for that recompute, on the GPU, every micro-batch
        self.kept_routing_bytes = t.grad_accum * kept_routing_bytes(spec.arch, self.mb_tokens) \
            if spec.moe and spec.recompute_stops_before_down_proj(chunked, self.lean) else 0
        # the head: forward + backward (2x); the chunked torch chain also recomputes the logits in its backward
        self.head_flops = (3 if fused else 4) * flops["head_forward_flops_per_token"] * self.step_tokens

    @property
    def kept_graph_bytes(self) -> int:
        """What one layer's kept autograd graph holds for all micro-batches (the tensors the recompute would
        rebuild), plus the layer's own slot."""
        per_micro_batch = layer_graph_bytes(self.spec, self.mb_tokens, self.compute_bytes, self.compiled,
                                            self.mlp_chunk_tokens, self.lean)
        return per_micro_batch * (self.step_tokens // self.mb_tokens) + self.slot_bytes(self.layouts[1])

    def slot_bytes(self, lay) -> int:
        return self.compute_bytes * lay.cast_numel + 4 * (lay.numel - lay.cast_numel)

    def resident_state_bytes(self, n_res: int) -> int:
        """The state (master + moments) of the first `n_res` units."""
        return self._state_upto[n_res]

    def own_slot_bytes(self, n_res: int) -> int:
        """The slots of their own that the GPU-resident layers take when weights are not cached."""
        return self._slot_upto[max(1, min(n_res, self.L + 1))] - self._slot_upto[1]

    def own_accumulator_bytes(self, n_res: int, n_gpu_updated: int) -> int:
        """The gradients of their own that the first `n_gpu_updated` units hold on the GPU when gradients go to the
        host, on the rank holding the most: fp32, each GPU-updated layer's accumulator, on every rank (each rank
        accumulates every unit's gradient before the sum over ranks); bf16 or int8, the held copies
        (`held_copy_bytes`), the accumulators being the shared ones."""
        if self.fmt.grad != "fp32":
            return self.held_copy_bytes(n_res, n_gpu_updated)
        return self.fmt.grad_bytes(self._numel_upto[max(1, min(n_gpu_updated, self.L + 1))] - self._numel_upto[1])

    def owners(self, n_res: int) -> Dict[int, int]:
        """The host-state units' owners with `n_res` GPU-resident units (engine/distributed.py, `state_owners`);
        empty on one rank."""
        if self.state_ranks <= 1:
            return {}
        if n_res not in self._owners:
            self._owners[n_res] = state_owners(self.spec, n_res, self.state_ranks)
        return self._owners[n_res]

    def _rank_grad_upto(self, n_res: int) -> List[List[int]]:
        """Per rank, the held-gradient bytes of the units before each index that the rank updates: the GPU-resident
        ones (every rank updates them) and its own host-state units."""
        if n_res not in self._owned_grad_upto:
            owner = self.owners(n_res)
            self._owned_grad_upto[n_res] = [
                list(accumulate((self._grad_upto[u + 1] - self._grad_upto[u] if owner.get(u, rank) == rank else 0
                                 for u in range(len(self.numels))), initial=0))
                for rank in range(self.state_ranks)]
        return self._owned_grad_upto[n_res]

    def _held_bytes(self, n_res: int, units: range) -> int:
        """The held gradients of `units` that one rank keeps, of the rank keeping the most: only the rank that updates
        a unit reads its held copy, so with sharded state each rank keeps its own units' and the GPU-resident ones'."""
        if not units:
            return 0
        if self.state_ranks <= 1:
            return self._grad_upto[units.stop] - self._grad_upto[units.start]
        return max(upto[units.stop] - upto[units.start] for upto in self._rank_grad_upto(n_res))

    def held_copy_bytes(self, n_res: int, n_gpu_updated: int, n_host_grads: int = 0) -> int:
        """The held bf16 or int8 gradient copies on the GPU (every unit's is held until the norm is known), of the
        rank holding the most: those of the first `n_gpu_updated` units that the rank updates, less the last
        `n_host_grads` GPU-streamed units', which wait on the host (`host_held_grad_bytes`)."""
        return self._held_bytes(n_res, range(0, n_gpu_updated - n_host_grads))

    def host_held_grad_bytes(self, n_res: int, n_gpu_updated: int, n_host_grads: int) -> int:
        """The held bf16 gradients of the last `n_host_grads` GPU-streamed units that wait in host memory, of the
        rank holding the most of them."""
        return self._held_bytes(n_res, self.host_grad_units(n_res, n_gpu_updated - n_res, n_host_grads))

    def split_bytes(self, n_res: int, n_str: int, grads_on_gpu: bool, cached: bool, norm_pass: bool = False) -> int:
        """GPU bytes the update places take beyond the fixed working set: resident state (+ the resident layers' own
        slots and accumulators), streamed staging (+ the streamed layers' accumulators). With a norm pass no unit
        has an accumulator of its own: every gradient is finished in the shared ones and used at once."""
        key = (n_res, n_str, grads_on_gpu, cached, norm_pass)
        if key not in self._split:
            nbytes = self.resident_state_bytes(n_res) + self.staging_bytes(n_res, n_str)
            if not grads_on_gpu and not norm_pass:
                nbytes += self.own_accumulator_bytes(n_res, n_res + n_str)
            if not cached:
                nbytes += self.own_slot_bytes(n_res)
            self._split[key] = nbytes
        return self._split[key]

    def transfer_bytes(self, numel: int) -> int:
        """A host-updated unit's gradient over D2H and in host memory: fp32, or bf16 with bf16 transfer."""
        return (2 if self.grad_transfer == "bf16" else 4) * numel

    def staging_bytes(self, n_res: int, n_str: int, n_host_grads: int = 0) -> int:
        """The GPU staging buffers of the streamed units' state, and of the held gradients of the last
        `n_host_grads` of them, which come in from the host beside it (engine/streaming/streamed_update.py)."""
        if not n_str:
            return 0
        key = (n_res, n_str, n_host_grads)
        if key not in self._staging:
            first_host_grad = n_res + n_str - n_host_grads
            self._staging[key] = min(N_STAGES, n_str) * max(
                self.fmt.state_bytes(n) + (self.fmt.grad_bytes(n) if u >= first_host_grad else 0)
                for u, n in enumerate(self.numels[n_res:n_res + n_str], n_res))
        return self._staging[key]

    def host_grad_units(self, n_res: int, n_str: int, n_host_grads: int) -> range:
        """The streamed units whose held bf16 gradients wait on the host: the last `n_host_grads`."""
        return range(n_res + n_str - n_host_grads, n_res + n_str)

    def host_grad_wire_bytes(self, n_res: int, units: range) -> int:
        """The bf16 copies on the GPU that the D2H of `units`' held gradients reads, on the rank holding the most: the
        embedding's and the head's accumulators when they are among the rank's units, the shared pair of layer
        accumulators when a decoder layer is."""
        owner = self.owners(n_res)

        def wired(rank: int) -> int:
            mine = [u for u in units if owner.get(u, rank) == rank]
            numel = sum(self.numels[u] for u in (0, self.L + 1) if u in mine)
            if any(0 < u <= self.L for u in mine):
                numel += min(2, self.L) * self.layer_numel
            return 2 * numel

        return max(wired(rank) for rank in range(max(1, self.state_ranks)))

    def host_grads_gpu_saving(self, n_res: int, n_str: int, n_host_grads: int) -> int:
        """GPU bytes freed by holding the last `n_host_grads` streamed units' bf16 gradients on the host: the
        gradients, less the wire copies their D2H reads and the staging buffers' growth (of the rank holding the most
        of each)."""
        if not n_host_grads:
            return 0
        n_gpu = n_res + n_str
        units = self.host_grad_units(n_res, n_str, n_host_grads)
        return (self.held_copy_bytes(n_res, n_gpu) - self.held_copy_bytes(n_res, n_gpu, n_host_grads)
                - self.host_grad_wire_bytes(n_res, units)
                - self.staging_bytes(n_res, n_str, n_host_grads) + self.staging_bytes(n_res, n_str))

    def host_grads_freeing(self, n_res: int, n_str: int, short_bytes: float) -> int:
        """The fewest streamed units (the last ones) whose held bf16 gradients, moved to the host, free
        `short_bytes` of GPU memory (`host_grads_gpu_saving`, which grows with the count: a bisection); 0 when
        none does."""
        if self.host_grads_gpu_saving(n_res, n_str, n_str) < short_bytes:
            return 0
        low, high = 0, n_str  # saving(low) < short_bytes <= saving(high)
        while high - low > 1:
            mid = (low + high) // 2
            if self.host_grads_gpu_saving(n_res, n_str, mid) >= short_bytes:
                high = mid
            else:
                low = mid
        return high
