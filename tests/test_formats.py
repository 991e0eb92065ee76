"""Training-state formats: bytes per parameter by format, and the planner's use of them (engine/formats.py)."""

import pytest
import torch

from engine import optim

from engine.formats import StateFormat, all_formats
from engine.model import ModelSpec
from engine.plan import GIB, PlanError, build_plan
from tests.util import FP32, SMALL, make_cfg


def test_bytes_per_format():
    n = 1000  # not a multiple of the block: the last block has its scales too
    assert StateFormat().state_bytes(n) == 12 * n and StateFormat().grad_bytes(n) == 4 * n
    assert StateFormat("bf16", "bf16", "bf16").state_bytes(n) == 6 * n
    int8 = StateFormat("bf16", "int8", "bf16", block_size=256)
    assert int8.moments_bytes(n) == 2 * n + 2 * 4 * 4
    assert int8.state_bytes(n) == 2 * n + int8.moments_bytes(n) and int8.grad_bytes(n) == 2 * n
    assert StateFormat("bf16", "int8", "int8", block_size=256).grad_bytes(n) == n + 4 * 4  # 4 blocks' scales
    assert StateFormat().exact and not int8.exact
    assert StateFormat().update_hbm_bytes(n) == 28 * n  # torch's fused AdamW writes no bf16 weights
    assert int8.update_hbm_bytes(n) == 2 * int8.state_bytes(n) + 2 * n + 2 * n


def test_every_format_is_listed_once_the_most_precise_first():
    formats = all_formats(128)
    assert len(set(formats)) == 2 * 3 * 3 and formats[0] == StateFormat(block_size=128)
    sizes = [f.bytes_per_param() for f in formats]
    assert sizes == sorted(sizes, reverse=True)
    assert formats[-1] == StateFormat("bf16", "int8", "int8", 128)


def test_auto_gradients_never_take_int8_which_only_an_explicit_setting_picks():
    from engine.formats import candidate_formats
    auto = make_cfg(["train.master_dtype=auto", "train.moments_dtype=auto", "train.grad_dtype=auto"]).train
    assert {f.grad for f in candidate_formats(auto)} == {"fp32", "bf16"}
    fixed = make_cfg(["train.master_dtype=auto", "train.moments_dtype=auto", "train.grad_dtype=int8"]).train
    assert {f.grad for f in candidate_formats(fixed)} == {"int8"}
    assert "train.moments_block_size=256" in StateFormat("bf16", "bf16", "int8").overrides()


def _plan(overrides, model="qwen7b", check=False, on_gpu=True):
    cfg = make_cfg([f"model={model}", "engine=stream", "hardware=h200", "train=bench", "train.seq_len=4096",
                    "plan=true", *overrides])
    return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=on_gpu, check=check)


@pytest.mark.parametrize("on_gpu", [True, False])
def test_a_low_precision_format_puts_every_update_on_the_gpu(on_gpu):
    plan = _plan(["train.micro_batch_size=2", "train.grad_accum=8", "train.master_dtype=bf16",
                  "train.moments_dtype=bf16"], on_gpu=on_gpu)
    p = plan.placement
    assert p.gpu_resident_units + p.gpu_streamed_units == 30  # embedding, 28 layers, head
    if on_gpu:
        assert plan.times_s["host_adamw"] == 0.0


def test_the_state_rows_are_the_formats_bytes():
    """Halving the moments' bytes halves the moments' share of the state, wherever the planner put it."""
    fp32, bf16 = (_plan(["train.micro_batch_size=2", "train.grad_accum=2", "engine.gpu_resident_units=0",
                         "engine.gpu_streamed_units=30", f"train.moments_dtype={m}"]) for m in ("fp32", "bf16"))
    n = ModelSpec(make_cfg(["model=qwen7b"]).model)
    numel = sum(u.layout.numel for u in n.units)

    def state(plan):
        return sum(b for tier, item, b in plan.rows if "Adam m + v" in item)
    assert state(fp32) == 12 * numel and state(bf16) == 8 * numel


def test_a_fixed_split_that_leaves_units_to_the_host_adamw_is_refused():
    with pytest.raises(PlanError, match=r"train.master_dtype=bf16 .* updated on the GPU only .*add up to 30"):
        _plan(["train.micro_batch_size=2", "train.grad_accum=2", "train.master_dtype=bf16",
               "engine.gpu_resident_units=4", "engine.gpu_streamed_units=20"])


def test_qwen32b_is_refused_with_the_formats_that_fit():
    """The default recipe needs ~400 GiB of host for qwen32b; the refusal names the formats with which the plan fits
    the H200 box, with their totals, and those plans do fit."""
    with pytest.raises(PlanError) as e:
        _plan(["train.micro_batch_size=2", "train.grad_accum=2", "train.master_dtype=fp32", "train.moments_dtype=fp32",
               "train.grad_dtype=fp32"], model="qwen32b", check=True)
    message = str(e.value)
    assert "fits with train.master_dtype=bf16 train.moments_dtype=int8 train.grad_dtype=bf16" in message
    assert "train.master_dtype=fp32 train.moments_dtype=fp32" not in message.split("Smaller training-state")[1]
    small = _plan(["train.micro_batch_size=2", "train.grad_accum=2", "train.master_dtype=bf16",
                   "train.moments_dtype=int8", "train.grad_dtype=bf16"], model="qwen32b")
    assert not small.problem() and small.total("host") <= 120 * GIB
    assert f"host {small.total('host') / GIB:.1f} GiB, GPU {small.total('gpu') / GIB:.1f} GiB" in message


def test_a_model_that_fits_in_no_format_says_only_why():
    with pytest.raises(PlanError) as e:
        _plan(["train.micro_batch_size=1", "train.grad_accum=1"], model="qwen72b", check=True)
    assert "Smaller training-state formats" not in str(e.value)


def _train_reference(overrides, steps, monkeypatch=None, kernel=True):
    """engine=reference on the CPU, SMALL model; with kernel=False the fused update runs its torch reference
    (streamtrain_kernels/reference.py) instead of the Triton kernel under the interpreter."""
    import streamtrain_kernels.adamw_update as K
    from tests.test_engine_equivalence import build

    if not kernel:
        monkeypatch.setattr(K, "uses_triton", lambda device: False)
    cfg, eng, data = build("reference", ["train.grad_accum=2", *overrides])
    t = cfg.train
    losses = []
    for step in range(steps):
        batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
        losses.append(eng.train_step(batches, optim.lr_at(step, t))["loss"])
    return losses, eng


FORMATS = {"bf16": ["train.master_dtype=bf16", "train.moments_dtype=bf16", "train.grad_dtype=fp32"],
           "int8": ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.moments_block_size=64",
                    "train.grad_dtype=bf16"],
           "int8-grads": ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.moments_block_size=64",
                          "train.grad_dtype=int8"]}


@pytest.mark.parametrize("name", FORMATS)
def test_the_fused_kernel_trains_as_the_plain_torch_update(monkeypatch, name):
    """engine=reference in a low-precision format, the Triton kernel (interpreter) against the plain-torch update
    of streamtrain_kernels/reference.py: the same losses and the same state, bit for bit, over three steps with
    clipping active (the stochastic rounding keyed alike)."""
    losses_k, eng_k = _train_reference(FORMATS[name], 3)
    losses_t, eng_t = _train_reference(FORMATS[name], 3, monkeypatch, kernel=False)
    assert losses_k == losses_t
    for a, b in zip(eng_k.opt.master + eng_k.opt.m + eng_k.opt.v, eng_t.opt.master + eng_t.opt.m + eng_t.opt.v):
        assert torch.equal(a, b)
    assert eng_k.opt.master[1].dtype == torch.bfloat16
    for flat, master in zip(eng_k.flat, eng_k.opt.master):
        assert torch.equal(flat, master.float())  # the model computes with the master's values


def test_fp32_state_through_the_kernel_trains_as_torchs_adamw():
    """train.fp32_update=kernel: engine=reference's fp32 state updated by the fused kernel (interpreter) through
    FormatAdamW in place of torch's AdamW. Over three steps with clipping active: the losses equal to rounding, the
    unit states (what a checkpoint holds) in the same names, shapes and dtypes, their values equal to rounding."""
    losses_t, eng_t = _train_reference([], 3)
    losses_k, eng_k = _train_reference(["train.fp32_update=kernel"], 3)
    assert eng_t.torch_adamw and not eng_k.torch_adamw
    assert losses_k[0] == losses_t[0] and losses_k == pytest.approx(losses_t, rel=1e-6)
    for index in range(len(eng_t.spec.units)):
        want, got = eng_t.unit_state(index), eng_k.unit_state(index)
        assert float(got["step"]) == float(want["step"]) == 3.0
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert got[key].keys() == want[key].keys(), key
            for name in want[key]:
                assert got[key][name].dtype == torch.float32 and got[key][name].shape == want[key][name].shape
                torch.testing.assert_close(got[key][name], want[key][name], rtol=1e-4, atol=1e-9)


def test_low_precision_formats_learn_like_fp32(monkeypatch):
    """Twelve steps of the plain-torch update: the loss falls in every format and stays near the fp32 run's."""
    fp32, _ = _train_reference([], 12)
    for name, over in FORMATS.items():
        low, _ = _train_reference(over, 12, monkeypatch, kernel=False)
        assert low[-1] < 0.9 * low[0], name
        assert abs(low[-1] - fp32[-1]) < 0.05 * fp32[-1], (name, low[-1], fp32[-1])


def test_a_format_plans_and_builds_with_streamed_units(tmp_path):
    """plan=true shows a low-precision format's split; the trainer builds the streaming engine on it (no refusal:
    GPU-streamed units and bf16 gradients run)."""
    from engine.trainer import Trainer

    Trainer(make_cfg(["engine=stream", "train.moments_dtype=int8", "plan=true"]), tmp_path / "plan")
    trainer = Trainer(make_cfg(["engine=stream", *SMALL, "model.num_hidden_layers=4", "train.master_dtype=bf16",
                                "train.moments_dtype=int8", "train.grad_dtype=bf16", "engine.gpu_resident_units=2",
                                "train.steps=1", "train.val_every=-1"]),
                      tmp_path / "run")
    assert trainer.engine.streamed_units == [2, 3, 4, 5]
    trainer.run()


@pytest.mark.parametrize("engine, over", [
    ("reference", FORMATS["int8"]),
    ("stream", ["train.master_dtype=bf16", "train.moments_dtype=bf16", "engine.gpu_resident_units=5"]),
    ("stream", ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.moments_block_size=64",
                "engine.gpu_resident_units=5"]),
    ("stream", [*FORMATS["int8"], "engine.gpu_resident_units=2"])])
def test_a_format_resumes_bit_exact(engine, over, tmp_path):
    """4 steps == 2, stop (checkpoint), resume, 2: the same losses and the same checkpointed state, bit for bit (the
    stochastic rounding is keyed by step, so a resumed run rounds as the uninterrupted one). A resume in another
    format is refused."""
    from engine.checkpoint.safetensors_io import SafetensorsFile
    from engine.config import ConfigError
    from engine.trainer import Trainer
    from tests.test_checkpoint import RECIPE, step_losses

    common = [*RECIPE, f"engine={engine}", "train.steps=4", "train.checkpoint_every=2", *over]
    whole, split = tmp_path / "whole", tmp_path / "split"
    Trainer(make_cfg(common), whole).run()
    Trainer(make_cfg([*common, "train.stop_at=2"]), split).run()
    Trainer(make_cfg([*common, "train.resume=auto"]), split).run()
    assert step_losses(split) == step_losses(whole)
    files = sorted((whole / "checkpoints" / "step_4").glob("unit_*.safetensors"))
    assert files
    for f in files:
        with SafetensorsFile(f) as a, SafetensorsFile(split / "checkpoints" / "step_4" / f.name) as b:
            assert a.keys() == b.keys()
            for k in a.keys():
                assert torch.equal(a.get(k), b.get(k)), k
            dtypes = {k.split(".")[0]: a.get(k).dtype for k in a.keys()}
            assert dtypes["master"] == torch.bfloat16
            assert ("flat" in dtypes) == ("train.moments_dtype=int8" in over)
    other = [c for c in common if not c.startswith("train.moments_dtype")] + ["train.moments_dtype=fp32"]
    with pytest.raises(ConfigError, match="train.moments_dtype"):
        Trainer(make_cfg([*other, "train.resume=auto"]), split)


def test_hf_export_of_a_format_casts_the_master(tmp_path):
    from engine.checkpoint.safetensors_io import SafetensorsFile
    from engine.trainer import Trainer
    from tests.test_checkpoint import RECIPE

    Trainer(make_cfg([*RECIPE, "train.steps=2", "train.export_hf=true", "train.export_dtype=fp32",
                      *FORMATS["bf16"]]), tmp_path).run()
    exported = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert exported
    with SafetensorsFile(exported[0]) as st:
        t = st.get(st.keys()[0])
    assert t.dtype == torch.float32 and torch.equal(t, t.bfloat16().float())  # bf16 values, written as fp32


STREAM_CASES = {  # format, placement of the 5 units (embedding, 3 layers, head)
    "bf16-all-resident": [*FORMATS["bf16"], "engine.gpu_resident_units=5"],
    "int8-fp32-grads-streamed": ["train.master_dtype=bf16", "train.moments_dtype=int8",
                                 "train.moments_block_size=64", "engine.gpu_resident_units=2",
                                 "engine.grads_tier=host"],
    "int8-bf16-grads-all-streamed": [*FORMATS["int8"], "engine.gpu_resident_units=0", "engine.slots=2"],
    "bf16-bf16-grads-streamed": ["train.master_dtype=bf16", "train.moments_dtype=bf16", "train.grad_dtype=bf16",
                                 "engine.gpu_resident_units=3", "engine.grads_tier=gpu"],
    # held bf16 gradients in host memory: the last 4 streamed units' (the head's accumulator and the shared pair of
    # layer accumulators get wire copies); the streamed embedding's stays on the device
    "int8-bf16-grads-on-host": [*FORMATS["int8"], "engine.gpu_resident_units=0", "engine.host_grad_units=4"],
    # held int8 gradients: the resident units' updates and the streamed ones' decode the codes
    "int8-int8-grads-streamed": [*FORMATS["int8-grads"], "engine.gpu_resident_units=2"],
    "fp32-master-bf16-moments-kept": ["train.moments_dtype=bf16", "engine.gpu_resident_units=1",
                                      "engine.keep_activation_layers=2"],
}


@pytest.mark.parametrize("name", STREAM_CASES)
def test_the_streaming_engine_trains_a_format_as_the_plain_torch_run(name):
    """engine=stream (on the CPU: the same schedule with stand-in streams) in each place a format's unit can be
    updated (GPU-resident, GPU-streamed through staging) with fp32, bf16 or int8 held gradients, against
    engine=reference in the same format: the same losses and the same master and moments, bit for bit, over four
    steps with clipping active. After step 2 the state is read (which applies the pending streamed updates without a
    slot, so the next forward loads those units' low-precision masters from host memory)."""
    from tests.test_engine_equivalence import build

    over = [*STREAM_CASES[name], "model.tie_word_embeddings=false", "train.grad_accum=2"]
    engines = {}
    for engine in ("reference", "stream"):
        extra = [o for o in over if o.startswith("engine.")] if engine == "stream" else []
        cfg, eng, data = build(engine, [o for o in over if not o.startswith("engine.")] + extra)
        t = cfg.train
        losses = []
        for step in range(4):
            batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
            losses.append(eng.train_step(batches, optim.lr_at(step, t))["loss"])
            if step == 1:
                eng.master_weights()
        engines[engine] = (losses, eng)
    (losses_r, ref), (losses_s, stream) = engines["reference"], engines["stream"]
    placement = [u for u in range(5) if u not in stream.resident_units]
    assert stream.streamed_units == placement
    host_grads = next((int(o.split("=")[1]) for o in over if o.startswith("engine.host_grad_units=")), 0)
    assert stream.host_held == placement[len(placement) - host_grads:]
    if stream.held:  # those units' held gradients live in the host store's buffers, the others' on the device
        assert all(stream.held[u].flat is stream.store.grads[u] for u in stream.host_held)
        assert stream.memory_bytes()["device_held_grads"] == sum(
            stream.fmt.grad_bytes(stream.store.layouts[u].numel) for u in range(5) if u not in stream.host_held)
    assert losses_r == losses_s
    opt_r, opt_s = ref.opt, stream.format_opt
    assert ref.master_weights().keys() == stream.master_weights().keys()  # applies the pending updates
    for a, b in zip(opt_r.master + opt_r.m + opt_r.v, opt_s.master + opt_s.m + opt_s.v):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if opt_r.m_scales:
        for a, b in zip(opt_r.m_scales + opt_r.v_scales, opt_s.m_scales + opt_s.v_scales):
            assert torch.equal(a, b)
    moments_r, moments_s = ref.adam_moments(), stream.adam_moments()
    assert moments_r.keys() == moments_s.keys() == ref.master_weights().keys()
    assert all(torch.equal(a, b) for k in moments_r for a, b in zip(moments_r[k], moments_s[k]))
    assert any(m.any() for m, _ in moments_r.values())
    stream.close()


def test_a_checkpoint_of_the_precision_key_resumes_as_the_fp32_formats():
    from engine.checkpoint.state import _current_keys, fingerprint_differences, run_fingerprint

    cfg = make_cfg(FP32)
    now = run_fingerprint(cfg, "data")
    old_train = {k: v for k, v in now["train"].items()
                 if k not in ("master_dtype", "moments_dtype", "grad_dtype", "moments_block_size")}
    old = {**now, "train": {**old_train, "precision": "fp32_master"}}
    assert fingerprint_differences(old, now)
    assert fingerprint_differences(_current_keys(old), now) == []
    bf16 = run_fingerprint(make_cfg([*FP32, "train.master_dtype=bf16"]), "data")
    assert [d[0] for d in fingerprint_differences(_current_keys(old), bf16)] == ["train.master_dtype"]
