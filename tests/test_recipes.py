"""The recipes people start from (conf/experiment/, conf/train/): each composes as `experiment=<name>`, the fine-tune
recipes' plans fit their cards, and the train groups' schedules are what their headers say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from engine import checkpoint, config, hardware, optim
from engine.config import check_overrides, validate
from engine.formats import StateFormat
from engine.model import ModelSpec
from engine.plan import PlanError, build_plan
from tests.util import ROOT, make_cfg

EXPERIMENTS = sorted(p.stem for p in (config.CONF_DIR / "experiment").glob("*.yaml"))
FINETUNE = [n for n in EXPERIMENTS if n.startswith("finetune_")]

# The state formats each fine-tune recipe's header says the planner picks on its card's profile: a planner change
# that picks others fails here, so that the header (conf/experiment/<name>.yaml) is updated with it.
FP32 = "train.master_dtype=fp32 train.moments_dtype=fp32 train.grad_dtype=fp32"
SMALL = "train.master_dtype=bf16 train.moments_dtype=int8 train.grad_dtype=bf16"
PLANNED_FORMATS = {
    "finetune_qwen7b_h100": FP32,
    "finetune_qwen7b_h200": FP32,
    "finetune_qwen14b_h100": "train.master_dtype=fp32 train.moments_dtype=int8 train.grad_dtype=bf16",
    "finetune_qwen14b_h200": "train.master_dtype=bf16 train.moments_dtype=fp32 train.grad_dtype=fp32",
    "finetune_qwen32b_h100": FP32,
    "finetune_qwen32b_h200": SMALL,
}


def compose_cfg(overrides):
    """The config `python train.py <overrides>` composes (the recipe's hardware kept: no hardware=cpu added)."""
    check_overrides(overrides)
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", *overrides])
    hardware.resolve(cfg)
    validate(cfg)
    return cfg


def recipe_defaults(name: str) -> dict:
    """The recipe's defaults list as {group: option}."""
    entries = OmegaConf.load(config.CONF_DIR / "experiment" / f"{name}.yaml").get("defaults", [])
    return {k.split()[-1].lstrip("/"): v for e in entries for k, v in e.items()}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """model name -> a directory holding the config.json of that model (all that plan=true reads of model.init)."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for model in ("qwen7b", "qwen14b", "qwen32b"):
        d = root / model
        d.mkdir()
        m = make_cfg([f"model={model}"], validated=False).model
        (d / "config.json").write_text(json.dumps(checkpoint.hf_config_dict(m, torch.bfloat16)))
        dirs[model] = d
    return dirs


def required(name: str, hf_dirs: dict, tmp_path: Path) -> list:
    """What the user must add to the command line of recipe `name`."""
    defaults = recipe_defaults(name)
    out = []
    if name.startswith("finetune_"):
        records = tmp_path / "chat.jsonl"
        records.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "hello"}]}) + "\n")
        out += [f"model.init=hf:{hf_dirs[defaults['model']]}", f"data.path={records}"]
    if "hardware" not in defaults:  # the benchmark recipes plan for the card their name says (hardware=auto else)
        out.append("hardware=cpu" if name == "tiny_cpu" else "hardware=h200")
    if "nvme" in name:
        out.append(f"hardware.nvme_dir={tmp_path}")
    return out


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_without_a_plus(name, hf_dirs, tmp_path):
    cfg = compose_cfg([f"experiment={name}", "plan=true", *required(name, hf_dirs, tmp_path)])
    defaults = recipe_defaults(name)
    for group in ("model", "engine", "hardware", "data"):
        if group in defaults:  # the recipe's choice wins over the primary config's
            assert cfg[group].name == defaults[group], group
    if "train" in defaults:
        expected = OmegaConf.load(config.CONF_DIR / "train" / f"{defaults['train']}.yaml")
        recipe_train = OmegaConf.load(config.CONF_DIR / "experiment" / f"{name}.yaml").get("train", {})
        for key, value in expected.items():
            assert cfg.train[key] == recipe_train.get(key, value), key


def test_the_command_line_wins_over_a_recipe_and_the_recipe_over_the_primary_config(hf_dirs, tmp_path):
    name = "finetune_qwen7b_h100"
    fill = required(name, hf_dirs, tmp_path)
    recipe = compose_cfg([f"experiment={name}", "plan=true", *fill])
    assert (recipe.model.name, recipe.engine.name, recipe.hardware.name, recipe.data.name) == \
        ("qwen7b", "stream", "h100", "chat")
    assert (recipe.train.steps, recipe.train.grad_accum, recipe.train.lr) == (1000, 16, 1e-5)
    cli = compose_cfg([f"experiment={name}", "plan=true", *fill, "train.steps=5", "train.grad_accum=3",
                       "hardware=h200", "engine=reference"])
    assert (cli.train.steps, cli.train.grad_accum, cli.hardware.name, cli.engine.name) == (5, 3, "h200", "reference")
    assert cli.train.lr == 1e-5 and cli.train.seq_len == recipe.train.seq_len  # the rest stays the recipe's


@pytest.mark.parametrize("name", FINETUNE)
def test_a_finetune_recipe_plans_to_fit_its_card(name, hf_dirs, tmp_path):
    """As `python train.py experiment=<name> model.init=... data.path=... plan=true` plans it from another machine:
    the card's profile (its HBM and the host it was measured on), state formats `auto`."""
    cfg = compose_cfg([f"experiment={name}", "plan=true", *required(name, hf_dirs, tmp_path)])
    t, hw = cfg.train, cfg.hardware
    assert hw.name == name.rsplit("_", 1)[1] and cfg.engine.name == "stream" and cfg.data.name == "chat"
    assert all(t[f] == "auto" for f in ("master_dtype", "moments_dtype", "grad_dtype"))
    assert t.micro_batch_size * t.grad_accum * t.seq_len == 65536
    plan = build_plan(ModelSpec(cfg.model), cfg, hardware.usable_gpu_gib(hw, 0.0), hw.profile_host_mem_gib,
                      on_gpu=True, check=False)
    assert not plan.problem(), plan.table() + "\n" + plan.problem()
    assert PLANNED_FORMATS[name] in StateFormat.of(cfg.train).overrides(), plan.format_choice


def _schedule(train: str):
    return make_cfg([f"train={train}"], validated=False).train


def test_the_finetune_schedule():
    t = _schedule("finetune")
    assert (t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, t.weight_decay) == (1e-5, 30, 1000, 0.1, 0.0)
    assert 0 < t.warmup_steps < t.steps and t.warmup_steps == round(0.03 * t.steps)
    assert (t.seq_len * t.micro_batch_size * t.grad_accum, t.val_every, t.val_batches) == (65536, 50, 16)
    assert t.checkpoint_minutes > 0 and t.checkpoint_at_end and t.export_hf
    assert optim.lr_at(t.warmup_steps - 1, t) == pytest.approx(t.lr)  # the peak, then cosine down to 10% of it
    assert optim.lr_at(t.steps - 1, t) == pytest.approx(t.lr * t.min_lr_ratio)


def test_the_pretrain_schedule():
    t = _schedule("pretrain")
    assert (t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, t.weight_decay) == (3e-4, 2000, 20000, 0.1, 0.1)
    assert 0 < t.warmup_steps < t.steps
    assert (t.seq_len * t.micro_batch_size * t.grad_accum, t.val_every) == (4096 * 64, 250)
    assert t.checkpoint_minutes > 0 and t.checkpoint_at_end
    assert optim.lr_at(t.steps - 1, t) == pytest.approx(t.lr * t.min_lr_ratio)


def test_the_bench_schedule_ramps_over_the_whole_run_and_saves_nothing():
    t = _schedule("bench")
    assert (t.lr, t.warmup_steps, t.steps) == (1e-4, 10, 10)
    assert [optim.lr_at(s, t) for s in range(t.steps)] == pytest.approx([1e-5 * (s + 1) for s in range(10)])
    assert t.checkpoint_minutes == 0 and not t.checkpoint_at_end and t.checkpoint_every == 0


def test_no_config_or_bench_command_names_the_old_spellings():
    """`train=throughput` became train=bench, and experiments are chosen without `+` (conf/config.yaml lists the
    group: `+experiment=` is refused by Hydra). bench/plan_backtest.py reads old rows' spellings on purpose."""
    assert not (config.CONF_DIR / "train" / "throughput.yaml").exists()
    files = [*config.CONF_DIR.rglob("*.yaml"), *(ROOT / "bench").glob("*.py"), ROOT / "bench" / "gpu_session.sh"]
    for path in files:
        if path.name != "plan_backtest.py":
            text = path.read_text()
            for old in ("override /train: throughput", "train=throughput", "+experiment="):
                assert old not in text, f"{path}: {old}"


def test_the_gptoss20b_h100_recipe_plans_the_micro_batches_that_hide_its_weight_stream():
    """Its header's figures: on the H100 profile `train.grad_accum=-1` takes 12 micro-batches of 4 x 4096 tokens, the
    first whose forward computes as long as it streams, and the plan fits."""
    cfg = compose_cfg(["experiment=bench_gptoss20b_h100", "plan=true"])
    plan = build_plan(ModelSpec(cfg.model), cfg, hardware.usable_gpu_gib(cfg.hardware, 0.0),
                      cfg.hardware.profile_host_mem_gib, on_gpu=True, check=False)
    assert not plan.problem(), plan.table() + "\n" + plan.problem()
    assert cfg.train.grad_accum == 12 and plan.link_bound_ratio() <= 1.0
    assert plan.times_s["step"] == pytest.approx(15.5, abs=0.05)


def test_the_qwen3_30b_a3b_h100_recipe_fits_by_its_int8_held_gradients():
    """Its header: on the H100 profile at 64K tokens a step the plan fits with int8 held gradients, all in HBM, and
    is refused with bf16 ones, whose refusal names the int8 gradients among the formats that fit."""
    cfg = compose_cfg(["experiment=bench_qwen3_30b_a3b_h100", "plan=true"])

    def plan_of(c, check=False):
        return build_plan(ModelSpec(c.model), c, hardware.usable_gpu_gib(c.hardware, 0.0),
                          c.hardware.profile_host_mem_gib, on_gpu=True, check=check)

    plan = plan_of(cfg)
    assert not plan.problem(), plan.table() + "\n" + plan.problem()
    assert plan.state_format == StateFormat("bf16", "int8", "int8") and plan.placement.host_grad_units == 0
    assert cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.train.seq_len == 65536
    assert plan.times_s["step"] == pytest.approx(7.5, abs=0.1)
    bf16_grads = compose_cfg(["experiment=bench_qwen3_30b_a3b_h100", "plan=true", "train.grad_dtype=bf16"])
    with pytest.raises(PlanError, match=r"host memory(.|\n)*train.grad_dtype=int8(.|\n)*int8 gradients train worse than bf16 ones"):
        plan_of(bf16_grads, check=True)
