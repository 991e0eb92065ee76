"""Shared test helpers: compose the real Hydra config with overrides, build engines and data from it."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from engine import config, hardware
from engine.config import register, validate

CONF_DIR = str(config.CONF_DIR)
register()

# A model small enough for many engine steps on 2 cores, with sizes that are not powers of two.
SMALL = ["model.hidden_size=72", "model.intermediate_size=100", "model.num_hidden_layers=3",
         "model.num_attention_heads=6", "model.num_key_value_heads=2", "model.vocab_size=256"]


def make_cfg(overrides=(), validated=True):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "hardware=cpu", *overrides])
    hardware.resolve(cfg)
    if validated:
        validate(cfg)
    return cfg
