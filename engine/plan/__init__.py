"""The planner: where every byte of state lives, and how long a step should take, decided before allocating.

Memory. Every state byte is counted in the run's formats (engine/formats.py: fp32 master + m + v is 12 B/param, a
4 B/param gradient; bf16 master + int8 moments + bf16 gradient about 6). For `engine=reference` everything sits on
the compute device: master, gradient and two moments, one kept layer input per layer per micro-batch and one layer's
working activations.

For `engine=stream` each unit is updated in one of three places (engine/placement.py), in forward order: the first
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

Data parallel (`state_ranks` > 1: the stream engine's state sharded over the ranks, engine/distributed.py). Every
rank makes the same plan, for its share of the micro-batches and of the host, and each row is that of the rank
holding the most of it: the host rows count the master and moments (and fp32 gradients) of the rank with the most
host state; held bf16 or int8 gradients are read only by the rank that updates the unit, so each rank holds those of
the GPU-resident units (updated on every rank) and of its own GPU-streamed units, on the GPU or (the last
`host_grad_units`, bf16) on the host. fp32 accumulators do not shrink with the ranks: every rank accumulates every
unit's gradient before the sum over ranks. With `engine.shard_state=false` every rank holds everything, as one.

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

Norm pass (`engine.norm_pass`, `Placement.norm_pass`: clipping without holding gradients). A first backward takes
only the global norm, a second computes the gradients again and updates each unit as soon as its gradient is
finished, so no gradient waits for the norm: the GPU holds the shared accumulators (embedding, head, two layers)
and no held copy or per-unit accumulator, the host only the host-updated units' gradients (which wait for the host
AdamW as without it); fp32 gradients, nothing kept or cached, one process. Time: one more head and backward (their
weights streamed again), the GPU-streamed units' state traffic moved from the next forward into the second backward,
that forward loading their weights plainly. With `auto` every placement (and, for `auto` state formats, every
format) is first planned holding the gradients, exactly as without the setting; only where nothing fits is the
search run again with a norm pass (its layer inputs may go to the host where on the GPU they leave no split room),
and taken when it fits. A plan of several data-parallel ranks never takes it (`on` is refused there).

Time. `predict_stream` models one step from the calibrated figures of the hardware profile (python -m engine.calibrate
measures them on the machine, for compiled and for eager templates: the planner uses the mode the run executes in,
never a figure fitted on the run it predicts): layer forward and backward (recompute included) TFLOPS, the head's,
H2D/D2H alone and both at once, the host AdamW alone and under PCIe load (or, where the profile has it, at its rate
measured inside earlier training steps, `hardware.cpu_adam_gparams_per_s_in_step`). The forward is a pipeline of the H2D
stream, the D2H stream, the host AdamW and compute (see `predict_stream`); `exposed_wait` is the forward's time
beyond its compute. Activation working-set figures are estimates (bytes per token per layer, from the tensors
autograd keeps in `decoder_layer`); `margin_gib` covers allocator fragmentation and the CUDA context on the GPU;
`hardware.host_process_gib` (calibrated) is the process's own host memory before any state, less
`hardware.host_compile_workers_gib` (torch.compile's worker processes) for a run that starts none (eager templates,
or `train.compile_in_process`); a refusal says when the plan would fit without them.

Modules: `build` (`build_plan`, the refusal's suggestions), `micro_batches` (`train.grad_accum=-1`: the micro-batches
a step chosen so that the forward hides the weight stream), `stream` (`StreamPlanner`: the placement search and a
placement's rows), `reference` (the oracle's plan), `memory` (`MemoryPlan`, `PlanError`, the process's own host
memory), `activations` (activation and working-set bytes), `shape` (`StepShape`: the numbers both models read),
`speeds` (`Speeds`: the calibrated figures), `time_model` (`predict_stream`; `StepTimer`, the same for the many
placements of one search). The planner's output for the engine is a `Placement` (engine/placement.py); what the run
executes (compiled, fused loss, attention backend) is an `Execution` (engine/execution.py), read by the planner and
the trainer alike.
"""

from engine.plan.activations import (layer_activation_bytes_per_token, layer_graph_bytes, layer_working_bytes,
                                     loss_activation_bytes)
from engine.plan.build import build_plan, formats_that_fit
from engine.plan.memory import GIB, MemoryPlan, PlanError
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds, attention_rates, width_rates
from engine.plan.stream import StreamPlanner
from engine.plan.time_model import predict_stream

__all__ = ["GIB", "MemoryPlan", "PlanError", "Speeds", "StepShape", "StreamPlanner", "attention_rates", "build_plan",
           "formats_that_fit",
           "layer_activation_bytes_per_token", "layer_graph_bytes", "layer_working_bytes", "loss_activation_bytes",
           "predict_stream", "width_rates"]
