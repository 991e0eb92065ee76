"""Hardware profiles: one file per card in the `hardware` config group (read from engine.config.CONF_DIR), with the
card's memory and measured speeds; `hardware=auto` picks the profile of the GPU torch sees (or `cpu`).

A memory cap is not a different card. `hardware.gpu_mem_cap_gib=24` caps this process's GPU memory (every
allocation of the caching allocator), so an H200 shows how a run fits a 24 GB card, while the planner's speeds and
the MFU peak stay the H200's. A profile of another card than the one torch sees is refused (its speeds would
describe a machine the run is not on), unless `hardware.other_card=true` asks for that card's figures; its
`gpu_mem_gib` then caps the process as well. `plan=true` plans for the named profile on any machine."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from engine.config import CONF_DIR, ConfigError, HardwareConfig

PROFILE_DIR = CONF_DIR / "hardware"
GPU_PROFILES = {"H100": "h100", "H200": "h200", "GH200": "gh200", "RTX 3090": "rtx3090", "RTX A6000": "a6000"}


def profile_for_gpu(name: str) -> str | None:
    """The profile of a GPU by its device name (the longest marker first: "GH200" before "H200"), or None."""
    for marker in sorted(GPU_PROFILES, key=len, reverse=True):
        if marker in name:
            return GPU_PROFILES[marker]
    return None


def detect_profile() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    profile = profile_for_gpu(name)
    if profile is not None:
        return profile
    raise ConfigError(f"hardware=auto: no profile in {PROFILE_DIR} for GPU {name!r}; pass hardware=<name> "
                      f"(one of {', '.join(sorted(p.stem for p in PROFILE_DIR.glob('*.yaml') if p.stem != 'auto'))})")


def resolve(cfg: DictConfig) -> None:
    """Replace `hardware=auto` by the detected profile, in place; refuse a profile of another card (module doc)."""
    hw = cfg.hardware
    if hw.name == "auto":
        profile = OmegaConf.load(PROFILE_DIR / f"{detect_profile()}.yaml")
        # a field set on the command line or by a recipe (anything but the schema's default) wins over the profile
        defaults = HardwareConfig(name="auto")
        chosen = {k: v for k, v in hw.items() if k != "name" and v != getattr(defaults, k)}
        with open_dict(cfg):
            cfg.hardware = OmegaConf.merge(hw, profile, chosen)
        return
    if hw.name in GPU_PROFILES.values() and not cfg.plan and not hw.other_card and torch.cuda.is_available():
        here = detect_profile()
        if here != hw.name:
            raise ConfigError(
                f"hardware={hw.name} describes another card than this one ({torch.cuda.get_device_name()}, profile "
                f"{here}): its speeds would plan a machine the run is not on. To see how the run fits "
                f"{hw.name}'s memory, use hardware={here} hardware.gpu_mem_cap_gib={hw.gpu_mem_gib:g}; to use "
                f"{hw.name}'s figures anyway, add hardware.other_card=true")


def usable_gpu_gib(hw, card_gib: float) -> float:
    """GPU memory the run may use: the card's, the profile's usable figure and the cap, whichever is least (those
    that are known, > 0); 0 when none is (a CPU profile)."""
    return min((x for x in (card_gib, hw.gpu_mem_gib, hw.gpu_mem_cap_gib) if x > 0), default=0.0)


def apply_gpu_cap(hw, device: torch.device) -> float:
    """Cap the caching allocator at `usable_gpu_gib`; returns it."""
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    usable = usable_gpu_gib(hw, total_gib)
    if usable < total_gib:
        torch.cuda.set_per_process_memory_fraction(usable / total_gib, device)
    return usable


def peak_tflops(hw, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The MFU denominator and the profile it comes from: the GPU this process really runs on, so that another
    card's profile (hardware=rtx3090 hardware.other_card=true on an H200) is not credited with that card's peak."""
    field = "peak_bf16_tflops" if dtype == torch.bfloat16 else "peak_fp32_tflops"
    name = hw.name
    if device.type == "cuda" and detect_profile() != hw.name:
        name = detect_profile()
        return float(OmegaConf.load(PROFILE_DIR / f"{name}.yaml")[field]), name
    return float(hw[field]), name
