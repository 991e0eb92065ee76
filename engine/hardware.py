"""Hardware profiles: `hardware=auto` picks the profile of the GPU torch sees (or `cpu`), and a profile whose
`gpu_mem_gib` is below the card's capacity caps this process's GPU memory, so a big card can stand in for a smaller
one (`hardware=rtx3090` on an H200 behaves like a 24 GB card for every allocation the caching allocator makes).
Profiles are the files of the `hardware` config group, read from the one conf directory (engine.config.CONF_DIR)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from engine.config import CONF_DIR, ConfigError

PROFILE_DIR = CONF_DIR / "hardware"
GPU_PROFILES = {"H200": "h200", "GH200": "gh200", "RTX 3090": "rtx3090", "RTX A6000": "a6000"}


def detect_profile() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for marker in sorted(GPU_PROFILES, key=len, reverse=True):
        if marker in name:
            return GPU_PROFILES[marker]
    raise ConfigError(f"hardware=auto: no profile in {PROFILE_DIR} for GPU {name!r}; pass hardware=<name> "
                      f"(one of {', '.join(sorted(p.stem for p in PROFILE_DIR.glob('*.yaml') if p.stem != 'auto'))})")


def resolve(cfg: DictConfig) -> None:
    """Replace `hardware=auto` by the detected profile, in place."""
    if cfg.hardware.name != "auto":
        return
    profile = OmegaConf.load(PROFILE_DIR / f"{detect_profile()}.yaml")
    with open_dict(cfg):
        cfg.hardware = OmegaConf.merge(cfg.hardware, profile)


def apply_gpu_cap(hw, device: torch.device) -> float:
    """Cap the caching allocator at hardware.gpu_mem_gib; returns the usable GiB."""
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    if 0 < hw.gpu_mem_gib < total_gib:
        torch.cuda.set_per_process_memory_fraction(hw.gpu_mem_gib / total_gib, device)
        return hw.gpu_mem_gib
    return total_gib


def peak_tflops(hw, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The MFU denominator and the profile it comes from: the GPU this process really runs on, so that a capped
    profile (hardware=rtx3090 on an H200) keeps its memory limit but is not credited with the smaller GPU's peak."""
    field = "peak_bf16_tflops" if dtype == torch.bfloat16 else "peak_fp32_tflops"
    name = hw.name
    if device.type == "cuda" and detect_profile() != hw.name:
        name = detect_profile()
        return float(OmegaConf.load(PROFILE_DIR / f"{name}.yaml")[field]), name
    return float(hw[field]), name
