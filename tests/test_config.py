"""Every model config composes, its layout has the published parameter count, and bad input is refused with a
message that names the problem (through validate, and through the real CLI for the user-facing path)."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from engine.config import ConfigError
from engine.metrics import count_params
from engine.model import ModelSpec
from tests.util import make_cfg

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = {  # shared/reference/models.md, recomputed from config.json and checked against checkpoint indexes
    "qwen0_5b": 494_032_768, "qwen1_5b": 1_543_714_304, "qwen3b": 3_085_938_688, "qwen7b": 7_615_616_512,
    "qwen14b": 14_770_033_664, "qwen32b": 32_763_876_352, "qwen72b": 72_706_203_648,
    "qwen3_8b": 8_190_735_360, "qwen3_14b": 14_768_307_200, "qwen3_32b": 32_762_123_264,
    "llama8b": 8_030_261_248, "llama70b": 70_553_706_496,
}


def test_every_model_file_is_covered():
    files = {p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")}
    assert files == set(PUBLISHED) | {"tiny"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_config_has_published_param_count(name):
    cfg = make_cfg([f"model={name}"])
    spec = ModelSpec(cfg.model)
    spec.check_expected_params()
    assert spec.num_params() == PUBLISHED[name] == cfg.model.expected_params == count_params(cfg.model)


def test_expected_params_mismatch_is_refused():
    cfg = make_cfg(["model=qwen7b", "model.num_hidden_layers=27"])
    with pytest.raises(ConfigError, match="expected_params"):
        ModelSpec(cfg.model).check_expected_params()


@pytest.mark.parametrize("override, pattern", [
    ("train.seq_len=0", "train.seq_len=0 must be >= 1"),
    ("train.seq_len=-5", "train.seq_len=-5"),
    ("train.grad_accum=0", "train.grad_accum=0 must be >= 1"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0 must be >= 1"),
    ("train.seq_len=999999", "exceeds model.max_position_embeddings"),
    ("data=memmap", "data=memmap needs data.path"),
    ("data=memmap data.path=/nonexistent/tokens.bin", "no such file"),
    ("engine.grads_tier=nvme", "engine.grads_tier='nvme' is not valid"),
    ("train.precision=fp8", "train.precision='fp8' is not valid"),
    ("model.num_key_value_heads=4", "not a multiple"),
])
def test_bad_values_name_the_key(override, pattern):
    cfg = make_cfg(override.split(), validated=False)
    with pytest.raises(ConfigError, match=pattern.replace("(", r"\(")):
        from engine.config import validate

        validate(cfg)


def test_mistyped_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as err:
        make_cfg(["train.sequence_len=64"])
    assert "sequence_len" in str(err.value)


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as err:
        make_cfg(["train.seq_len=long"])
    assert isinstance(err.value.__cause__, ValidationError) and "seq_len" in str(err.value.__cause__)


def test_unknown_key_in_a_group_file_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from engine.config import Config

    schema = OmegaConf.structured(Config)
    with pytest.raises(ConfigKeyError, match="hiden_size"):
        OmegaConf.merge(schema, {"model": {"hiden_size": 3}})


def _cli(*args):
    return subprocess.run([sys.executable, "train.py", "logger=none", "hardware=cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_unknown_model_lists_choices():
    out = _cli("model=qwen8b")
    assert out.returncode != 0
    assert "qwen8b" in out.stderr and "qwen7b" in out.stderr  # Hydra lists the available options


def test_cli_bad_value_is_a_clean_error():
    out = _cli("train.grad_accum=0")
    assert out.returncode == 2
    assert "train.grad_accum=0 must be >= 1" in out.stderr and "Traceback" not in out.stderr


def test_cli_missing_data_file():
    out = _cli("data=memmap", "data.path=/nonexistent/tokens.bin")
    assert out.returncode == 2 and "/nonexistent/tokens.bin" in out.stderr


def test_cli_plan_prints_bytes_per_tier_without_training():
    out = _cli("model=qwen7b", "engine=stream", "plan=true", "hardware=h200")
    assert out.returncode == 0, out.stderr
    assert "fp32 master, Adam m + v" in out.stdout and "host" in out.stdout and "predicted step" in out.stdout
    assert "step 1/" not in out.stdout
