"""The time model: one streamed step's phases predicted from the calibrated speeds, for a given placement."""

from __future__ import annotations

from typing import Dict, Tuple

from engine.distributed import state_owners
from engine.placement import Placement
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds
from engine.streaming.nvme import file_bytes as nvme_file_bytes

HBM_ADAMW_BYTES_PER_S = 3.0e12  # fused CUDA AdamW: ~28 B/param of HBM traffic at about 3 TB/s
STEP_OVERHEAD_S = 0.03  # per step: norm synchronisation, optimizer hand-off, Python


def predict_stream(s: StepShape, sp: Speeds, placement: Placement) -> Tuple[Dict[str, float], str]:
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
    again, the kept input brought in; on the host tier its regenerated inputs go out over D2H and come back one by
    one). The binding resource has the most busy time.

    Sharded state (`s.state_ranks` > 1, engine/distributed.py): a unit's host update, its H2D and its gradient's D2H
    run on its owner's CPU and link, so each rank's AdamW clock and link are pipelines of their own (the ring's
    slots bound how many loads are in flight). The backward is the larger of its compute and the busiest link's
    transfers. Not modelled: the NVLink traffic (each slot's broadcast and each gradient's reduce, at several times
    the PCIe rate, on a stream of their own)."""
    n_res = placement.gpu_resident_units
    cached = placement.cache_weights
    grads_host = placement.grads_tier == "host"
    activations_host = placement.activation_tier == "host"
    n_units = len(s.layouts)
    numel = [lay.numel for lay in s.layouts]
    place = [placement.place_of(u) for u in range(n_units)]
    link_each = min(sp.h2d, sp.d2h, sp.bidir / 2)  # each direction's rate while both stream
    layer_input_bytes = 4 * s.h * s.step_tokens  # one layer's kept inputs, all micro-batches
    compute = [sp.layer_fwd_s(s) if 1 <= u <= s.L else 0.0 for u in range(n_units)]
    first_kept = s.L - placement.keep_activation_layers + 1  # layers from here on keep their graphs
    g = placement.recompute_group
    kept_inputs = placement.kept_layer_inputs
    kept_attention = set(placement.kept_attention_units)
    on_disk = set(placement.disk_units)

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
    slots = n_units if cached else placement.slots
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
        attention_kept = u in kept_attention  # a lean layer's attention output kept: no attention forward again
        layer_compute = sp.layer_bwd_s(s, 2) if kept else sp.layer_bwd_s(s, 3, s.recompute_skipped_flops,
                                                                          2 if attention_kept else None)
        h2d = [0.0] * ranks
        h2d[link[u]] = 0.0 if kept else weights_in(u)
        regenerated_out = 0.0
        if not kept and (u % g == 0 or u == first_kept - 1):  # the last layer of its group: regenerate the group
            others = range(u - (u - 1) % g, u)  # the layers from the one reading the kept input up to u - 1
            layer_compute += sp.layer_fwd_s(s, len(others))
            for v in others:
                h2d[link[v]] += weights_in(v)
            if activations_host:  # the kept input comes in; the regenerated ones go out, and back in for their layers
                regenerated_out = len(others) * layer_input_bytes / sp.d2h
                for q in range(ranks):
                    h2d[q] += (1 + len(others)) * layer_input_bytes / sp.h2d
        grad_out = s.transfer_bytes(numel[u]) / sp.d2h if grads_host and place[u] == "host" else 0.0
        backward += max(layer_compute, max(h2d), grad_out + regenerated_out)
        bwd_compute += layer_compute
        for q in range(ranks):
            bwd_h2d[q] += h2d[q]
        bwd_d2h[link[u]] += grad_out
        for q in range(ranks):
            bwd_d2h[q] += regenerated_out
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

