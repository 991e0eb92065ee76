"""The time model: one streamed step's phases predicted from the calibrated speeds, for a given placement."""

from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, NamedTuple, Tuple

from engine.distributed import state_owners
from engine.placement import Placement
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds
from engine.streaming.nvme import file_bytes as nvme_file_bytes

HBM_ADAMW_BYTES_PER_S = 3.0e12  # fused CUDA AdamW: ~28 B/param of HBM traffic at about 3 TB/s
STEP_OVERHEAD_S = 0.03  # per step: norm synchronisation, optimizer hand-off, Python


class Forward(NamedTuple):
    """One placement's forward (`StepTimer._forward`): its time, and per rank the host AdamW's and the links'
    busy time."""
    time: float
    host_adamw: Tuple[float, ...]
    h2d_busy: Tuple[float, ...]
    d2h_busy: Tuple[float, ...]


def predict_stream(s: StepShape, sp: Speeds, placement: Placement) -> Tuple[Dict[str, float], str]:
    """(phase times, binding resource) of one streamed step under `placement`.

    Forward: a pipeline of four resources (H2D, D2H, host AdamW, compute) in unit order. The H2D stream brings unit
    u in (nothing for a GPU-resident unit, its fp32 master for a host-updated one, master + m + v for a GPU-streamed
    one, whose state also goes back over D2H, and whose held bf16 gradient comes in beside it when it waited on the
    host; both directions then share the link's bidirectional rate); a load
    starts once the host AdamW has updated the unit, its slot is free (the ring holds `slots` units) and, for a
    streamed unit, its staging buffer is free (two buffers per rank, each freed by the D2H of the rank's unit that
    used it). Compute runs each unit when its
    weights are in. The host AdamW updates its units in order from the start of the forward, at its rate under PCIe
    load; a transfer that starts while it runs moves at the link's rate under the optimizer (`bidir_gbps_under_adam`
    over `bidir_gbps`, in both directions: of qwen7b's forward wait at 64K tokens that the plan missed, this accounts
    for half on an H100 and most on an H200, `bench/plan_backtest.py`). Exposed wait: forward time beyond its
    compute. Backward: per layer the larger of its compute and its transfers; the backward reaches a recompute
    group at its last layer, which also regenerates the group (the forward of its other layers, their weights loaded
    again, the kept input brought in; on the host tier its regenerated inputs go out over D2H and come back one by
    one). The binding resource has the most busy time.

    Norm pass (`placement.norm_pass`: clipping without holding gradients). A first backward (`norm_pass`: the head
    and the layers' backward) takes the norm only: its transfers are the backward's weights and kept inputs, no
    gradient goes out. The second (`head`, `backward`) updates each unit as its gradient is finished: a GPU-streamed
    unit's master, m and v come in and go back in that backward beside its weights (the traffic a streamed update
    otherwise has in the next forward; the embedding's and the head's, before and after the layers, hide behind no
    compute), host-updated units' gradients go out as they do without it. The next forward then loads a GPU-streamed
    unit's weights as it loads a host-updated one's, nothing going back.

    Sharded state (`s.state_ranks` > 1, engine/distributed.py): a unit's host update, its H2D and its gradient's D2H
    run on its owner's CPU and link, so each rank's AdamW clock and link are pipelines of their own (the ring's
    slots bound how many loads are in flight). The backward is the larger of its compute and the busiest link's
    transfers. Not modelled: the NVLink traffic (each slot's broadcast and each gradient's reduce, at several times
    the PCIe rate, on a stream of their own)."""
    return StepTimer(s, sp).predict(placement)


class StepTimer:
    """`predict_stream` for the many placements of one search (some 10^4 per plan). What does not depend on the
    placement is computed here once, each figure the float the per-placement expression gives: each unit's transfer,
    host update and compute time, a layer's backward, the GPU AdamW of each resident prefix. The forward reads only
    the split, the ring, the layer inputs sent to the host and the NVMe units, not the kept-graph count or the
    recompute group the search varies fastest: each such layout's forward is kept (`_forwards`, a few thousand at
    most). Reads `sp` when built: a changed Speeds needs a new StepTimer."""

    def __init__(self, s: StepShape, sp: Speeds):
        self.spec = s.spec
        self.n_units, self.L, self.ranks = len(s.layouts), s.L, s.state_ranks
        numel = s.numels
        link_each = min(sp.h2d, sp.d2h, sp.bidir / 2)  # each direction's rate while both stream
        self.streamed_s = [s.fmt.state_bytes(n) / link_each for n in numel]  # a streamed unit's state, each way
        self.master_s = [s.fmt.master_bytes(n) / sp.h2d for n in numel]  # a host-updated unit's master, or weights
        self.grad_out_s = [s.transfer_bytes(n) / sp.d2h for n in numel]  # a host-updated unit's gradient
        # a streamed unit's held bf16 gradient that waits on the host: out in the backward, in at its update
        self.held_grad_out_s = [s.fmt.grad_bytes(n) / sp.d2h for n in numel]
        self.held_grad_in_s = [s.fmt.grad_bytes(n) / link_each for n in numel]
        # the host AdamW of each unit; for a unit in the NVMe tier, the longer of that and its moments' I/O
        self.adam_s = [n / sp.adam_pcie for n in numel]
        self.adam_disk_s = [max(adam, 2 * nvme_file_bytes([n]) / sp.nvme) if sp.nvme else adam
                            for adam, n in zip(self.adam_s, numel)]
        self.slowdown = 1.0 / sp.link_under_adam  # a transfer that starts while its rank's host AdamW runs
        self.layer_input_bytes = 4 * s.h * s.step_tokens  # one layer's kept inputs, all micro-batches
        self.input_out_s = self.layer_input_bytes / sp.d2h
        self.h2d, self.d2h = sp.h2d, sp.d2h
        self.layer_fwd = sp.layer_fwd_s(s)  # sp.layer_fwd_s(s, k) is k times this
        self.compute = [self.layer_fwd if 1 <= u <= s.L else 0.0 for u in range(self.n_units)]
        self.forward_compute = sum(self.compute)
        self.bwd_recomputed = sp.layer_bwd_s(s, 3, s.recompute_skipped_flops, None)
        self.bwd_attention_kept = sp.layer_bwd_s(s, 3, s.recompute_skipped_flops, 2)
        # a kept lean layer's graph is the lean layer's autograd Function, whose backward rebuilds every op but the
        # attention's forward chunk by chunk (engine/model/lean.py): its attention output kept, not a whole graph
        self.bwd_kept = self.bwd_attention_kept if s.lean else sp.layer_bwd_s(s, 2)
        self.head = s.head_flops / sp.head
        self.resident_adam = [s.fmt.update_hbm_bytes(n) / HBM_ADAMW_BYTES_PER_S  # per GPU-resident count
                              for n in accumulate(numel, initial=0)]
        self._links: Dict[int, List[int]] = {}  # per GPU-resident count: the rank whose link carries each unit
        self._forwards: Dict[tuple, Forward] = {}  # per `_forward`'s arguments

    def links(self, n_res: int) -> List[int]:
        """Whose CPU updates and whose link carries each unit, with `n_res` GPU-resident units."""
        if n_res not in self._links:
            owner = state_owners(self.spec, n_res, self.ranks) if self.ranks > 1 else {}
            self._links[n_res] = [owner.get(u, 0) for u in range(self.n_units)]
        return self._links[n_res]

    def predict(self, placement: Placement) -> Tuple[Dict[str, float], str]:
        """(phase times, binding resource) of one streamed step under `placement` (`predict_stream`)."""
        n_res = placement.gpu_resident_units
        on_disk = tuple(placement.disk_units)
        layout = (n_res, n_res + placement.gpu_streamed_units,
                  self.n_units if placement.cache_weights else placement.slots,
                  placement.kept_layer_inputs if placement.activation_tier == "host" else range(0), on_disk,
                  placement.host_grad_units_range.start, placement.norm_pass)
        if layout not in self._forwards:
            self._forwards[layout] = self._forward(*layout)
        t_fwd, host_adamw, h2d_busy, d2h_busy = self._forwards[layout]
        link = self.links(n_res)
        backward, bwd_h2d, bwd_d2h = self._backward(placement, link, grads_out=True)
        norm_pass = 0.0
        if placement.norm_pass:
            first, first_h2d, first_d2h = self._backward(placement, link, grads_out=False)
            norm_pass = self.head + first
            bwd_h2d = [a + b for a, b in zip(bwd_h2d, first_h2d)]
            bwd_d2h = [a + b for a, b in zip(bwd_d2h, first_d2h)]
        host_total = max(host_adamw)  # the busiest rank's
        times = {"forward": t_fwd, "forward_compute": self.forward_compute, "forward_h2d": max(h2d_busy),
                 "forward_d2h": max(d2h_busy), "head": self.head, "backward": backward,
                 "gpu_resident_adamw": self.resident_adam[n_res], "host_adamw": host_total,
                 "exposed_wait": t_fwd - self.forward_compute}
        if placement.norm_pass:
            times["norm_pass"] = norm_pass
        times["step"] = t_fwd + norm_pass + self.head + backward + self.resident_adam[n_res] + STEP_OVERHEAD_S
        busy_by = {"GPU compute": self.forward_compute + norm_pass + self.head + backward,
                   "H2D": max(a + b for a, b in zip(h2d_busy, bwd_h2d)),
                   "D2H": max(a + b for a, b in zip(d2h_busy, bwd_d2h)),
                   "host AdamW" if not on_disk else "host AdamW + NVMe": host_total}
        return times, max(busy_by, key=busy_by.get)

    def _forward(self, n_res: int, n_gpu: int, slots: int, sent_inputs: range, on_disk: Tuple[int, ...],
                 first_host_grad: int, norm_pass: bool) -> Forward:
        """The forward's pipeline (`predict_stream`) with the first `n_res` units GPU-resident, the next ones up to
        `n_gpu` GPU-streamed (from `first_host_grad` on with their held gradients coming in from the host; with a
        `norm_pass` already updated, their weights loaded as a host-updated unit's), a ring of `slots`, the inputs
        of layers `sent_inputs` (0-based) going to the host and the units `on_disk` in the NVMe tier."""
        n_units, L, ranks, slow, link = self.n_units, self.L, self.ranks, self.slowdown, self.links(n_res)
        # the host AdamW updates its units (the last ones) in order from the start of the forward
        host_done, clock = [0.0] * n_units, [0.0] * ranks
        for u in range(n_gpu, n_units):
            clock[link[u]] += self.adam_disk_s[u] if u in on_disk else self.adam_s[u]
            host_done[u] = clock[link[u]]
        h2d_end, end = [0.0] * n_units, [0.0] * n_units
        h2d_prev, d2h_prev, end_prev = [0.0] * ranks, [0.0] * ranks, 0.0
        h2d_busy, d2h_busy = [0.0] * ranks, [0.0] * ranks
        staged: List[List[float]] = [[] for _ in range(ranks)]  # per rank, the D2H ends of its streamed units so far
        for u in range(n_units):
            r = link[u]
            start = max(h2d_prev[r], host_done[u])
            if 1 <= u <= L and u - slots >= 1:
                start = max(start, end[u - slots])
            d2h_t = 0.0
            if u < n_res:
                h2d_t = 0.0
            elif u < n_gpu and not norm_pass:  # streamed: master + m + v in, and out, through two staging buffers
                if len(staged[r]) >= 2:
                    start = max(start, staged[r][-2])
                h2d_t = d2h_t = self.streamed_s[u]
                if u >= first_host_grad:
                    h2d_t += self.held_grad_in_s[u]
            else:
                h2d_t = self.master_s[u]
            if start < clock[r]:
                h2d_t *= slow
            h2d_end[u] = h2d_prev[r] = start + h2d_t
            if max(d2h_prev[r], h2d_end[u]) < clock[r]:
                d2h_t *= slow
            # each rank's kept activations go out over its own link
            act_t = self.input_out_s if u - 1 in sent_inputs else 0.0
            for q in range(ranks):
                d2h_prev[q] = max(d2h_prev[q], h2d_end[u]) + act_t + (d2h_t if q == r else 0.0)
                d2h_busy[q] += act_t + (d2h_t if q == r else 0.0)
            if n_res <= u < n_gpu and not norm_pass:
                staged[r].append(d2h_prev[r])
            h2d_busy[r] += h2d_t
            end[u] = end_prev = max(end_prev, h2d_end[u]) + self.compute[u]
        return Forward(end[-1], tuple(clock), tuple(h2d_busy), tuple(d2h_busy))

    def _backward(self, placement: Placement, link: List[int],
                  grads_out: bool) -> Tuple[float, List[float], List[float]]:
        """The backward (`predict_stream`): (its time, each rank's H2D and D2H busy time). `grads_out`: it sends the
        gradients (a norm pass's first backward does not), and with a norm pass it also carries the streamed
        updates' state."""
        L, ranks, g, master_s = self.L, self.ranks, placement.recompute_group, self.master_s
        n_res, cached = placement.gpu_resident_units, placement.cache_weights
        n_gpu = n_res + placement.gpu_streamed_units
        first_kept = L - placement.keep_activation_layers + 1  # layers from here on keep their graphs
        kept_attention = placement.kept_attention_units
        activations_host = placement.activation_tier == "host"
        grads_host = placement.grads_tier == "host"
        host_grads = placement.host_grad_units_range
        updates = placement.norm_pass and grads_out  # the streamed updates run in this backward
        backward, bwd_compute, bwd_h2d, bwd_d2h = 0.0, 0.0, [0.0] * ranks, [0.0] * ranks
        for u in range(1, L + 1):
            kept = u >= first_kept  # its graph was kept: no recompute, no reload of its weights or inputs
            if kept:
                layer_compute = self.bwd_kept
            else:  # a lean layer's attention output kept: no attention forward again
                layer_compute = self.bwd_attention_kept if u in kept_attention else self.bwd_recomputed
            h2d = [0.0] * ranks
            h2d[link[u]] = 0.0 if kept or cached or u < n_res else master_s[u]  # its weights in again
            regenerated_out = 0.0
            if not kept and (u % g == 0 or u == first_kept - 1):  # the last layer of its group: regenerate the group
                others = range(u - (u - 1) % g, u)  # the layers from the one reading the kept input up to u - 1
                layer_compute += len(others) * self.layer_fwd
                for v in others:
                    h2d[link[v]] += 0.0 if cached or v < n_res else master_s[v]
                if activations_host:  # the kept input comes in; the regenerated ones go out, and back for their layers
                    regenerated_out = len(others) * self.layer_input_bytes / self.d2h
                    for q in range(ranks):
                        h2d[q] += (1 + len(others)) * self.layer_input_bytes / self.h2d
            grad_out = self.grad_out_s[u] if grads_out and grads_host and u >= n_gpu else 0.0
            if u in host_grads:
                grad_out = self.held_grad_out_s[u]
            if updates and n_res <= u < n_gpu:  # its state in and back out, at the rate of both directions at once
                h2d[link[u]] += self.streamed_s[u]
                grad_out += self.streamed_s[u]
            backward += max(layer_compute, max(h2d), grad_out + regenerated_out)
            bwd_compute += layer_compute
            for q in range(ranks):
                bwd_h2d[q] += h2d[q]
            bwd_d2h[link[u]] += grad_out
            for q in range(ranks):
                bwd_d2h[q] += regenerated_out
        if updates:  # the head's update before the layers, the embedding's after them
            for u in (L + 1, 0):
                if n_res <= u < n_gpu:
                    backward += self.streamed_s[u]
                    bwd_h2d[link[u]] += self.streamed_s[u]
                    bwd_d2h[link[u]] += self.streamed_s[u]
        if ranks > 1:  # the ranks' links work side by side: the busiest one, or the compute, sets the pace
            backward = max(bwd_compute, max(bwd_h2d), max(bwd_d2h))
        return backward, bwd_h2d, bwd_d2h
