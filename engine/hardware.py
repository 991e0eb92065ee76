"""Hardware profiles: one file per card in the `hardware` config group (read from engine.config.CONF_DIR), with the
card's memory and measured speeds; `hardware=auto` picks the profile of the GPU torch sees (or `cpu`).

A memory cap is not a different card. `hardware.gpu_mem_cap_gib=24` caps this process's GPU memory (every
allocation of the caching allocator), so an H200 shows how a run fits a 24 GB card, while the planner's speeds and
the MFU peak stay the H200's. A profile of another card than the one torch sees is refused (its speeds would
describe a machine the run is not on), unless `hardware.other_card=true` asks for that card's figures; its
`gpu_mem_gib` then caps the process as well. `plan=true` plans for the named profile on any machine.

Host memory is the machine's, not the profile's (`host_budget`): a run plans against what it has, measured at
start-up (`measure_host_memory_gib`: the cgroup limit or the machine's total, less what other processes use), or
`hardware.host_mem_gib` when set. A profile's `profile_host_mem_gib` (the host of the machine it was measured on)
is used only by `plan=true` for another machine's profile, so a plan for an H200 made on a laptop sees the H200's
host."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from engine.config import CONF_DIR, ConfigError, HardwareConfig

PROFILE_DIR = CONF_DIR / "hardware"
GIB = 2**30
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


CGROUP_DIR = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
SELF_STATUS = Path("/proc/self/status")
# a cgroup "limit" at or above this is no limit (v1 writes 2**63 rounded down to the page size for none)
NO_LIMIT_BYTES = 2**60


def _read_int(path: Path) -> Optional[int]:
    """The integer in a one-value file (a cgroup knob), None when it is missing, unreadable or "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_field(path: Path, key: str) -> int:
    """A field of a cgroup memory.stat file (bytes), 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_memory(cgroup_dir: Path) -> Optional[tuple[int, int, str]]:
    """(limit, bytes still free to the cgroup, "cgroup v1"/"cgroup v2") of the cgroup at `cgroup_dir`, None without
    a limit. Free: the limit less the usage, the cgroup's reclaimable page cache (inactive files) counted free."""
    for version, limit_file, usage_file, stat_file, inactive in (
            ("cgroup v2", "memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("cgroup v1", "memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        limit = _read_int(cgroup_dir / limit_file)
        if limit is None or limit >= NO_LIMIT_BYTES:
            continue
        usage = _read_int(cgroup_dir / usage_file)
        if usage is None:
            return limit, limit, version
        free = limit - usage + _stat_field(cgroup_dir / stat_file, inactive)
        return limit, min(limit, max(0, free)), version
    return None


def _meminfo(meminfo: Path) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from a /proc/meminfo file."""
    fields = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if rest.split() and rest.split()[0].isdigit():
                fields[name] = int(rest.split()[0]) * 1024  # kB
    except OSError as err:
        raise ConfigError(f"cannot read this machine's memory from {meminfo} ({err}); set hardware.host_mem_gib "
                          "(GiB of host RAM the run may use)") from None
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        raise ConfigError(f"{meminfo} names no MemTotal and MemAvailable; set hardware.host_mem_gib (GiB of host RAM "
                          "the run may use)")
    return fields["MemTotal"], fields["MemAvailable"]


def _own_rss(status: Path) -> int:
    """This process's resident memory in bytes (VmRSS of /proc/self/status), 0 when unknown."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def measure_host_memory_gib(cgroup_dir: Path = CGROUP_DIR, meminfo: Path = MEMINFO,
                            status: Path = SELF_STATUS) -> tuple[float, str]:
    """The host memory this process may plan with, in GiB, and one line saying where it comes from.

    The ceiling is the memory cgroup's limit (v2 `memory.max`, v1 `memory.limit_in_bytes`; "max" or a huge value is
    none), else the machine's total. Of it, what other processes hold is not ours: the figure is the memory still
    available (the machine's MemAvailable, and within a cgroup the limit less its usage, reclaimable page cache
    counted free; the lesser of the two) plus this process's own resident memory, which the plan counts itself
    (`hardware.host_process_gib`). psutil, when installed, reads the machine's figures for the default paths; the
    paths are arguments so that a test can hand fake files."""
    psutil = None
    if meminfo == MEMINFO and status == SELF_STATUS:
        try:
            import psutil
        except ImportError:
            psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        total, available, rss, reader = vm.total, vm.available, psutil.Process().memory_info().rss, "psutil"
    else:
        (total, available), rss, reader = _meminfo(meminfo), _own_rss(status), str(meminfo)
    ceiling, where = total, f"this machine's {total / GIB:.1f} GiB per {reader}"
    cgroup = _cgroup_memory(cgroup_dir)
    if cgroup is not None and cgroup[0] < total:
        limit, cgroup_free, version = cgroup
        ceiling, available = limit, min(available, cgroup_free)
        where = f"{version} limit {limit / GIB:.1f} GiB at {cgroup_dir}"
    gib = min(ceiling, available + rss) / GIB
    return gib, f"{where}, {gib:.1f} GiB of it available, this process's {rss / GIB:.1f} GiB included"


class HostBudget(float):
    """GiB of host RAM a plan is held to, carrying where the figure comes from (`source`: the plan's table and
    refusals print it, `MemoryPlan.host_source`). It is a float, so the planner reads it as any other budget."""

    source: str

    def __new__(cls, gib: float, source: str):
        budget = super().__new__(cls, gib)
        budget.source = source
        return budget

    def __getnewargs__(self):  # pickled whole (torch.distributed's object broadcast)
        return float(self), self.source

    def per_rank(self, ranks: int) -> "HostBudget":
        """The share of each of `ranks` processes of one host (data parallel: they share its RAM)."""
        if ranks == 1:
            return self
        return HostBudget(self / ranks, f"1/{ranks} of {float(self):.1f} GiB per rank: {self.source}")


def describes_this_machine(name: str) -> bool:
    """Whether the profile `name` is the one `hardware=auto` picks here, or its multi-card variant (h100x4) on a host
    with that many of the card."""
    try:
        here = detect_profile()
    except ConfigError:  # a GPU without a profile: no profile describes this machine
        return False
    if name == here:
        return True
    return torch.cuda.is_available() and name == f"{here}x{torch.cuda.device_count()}"


def host_budget(cfg: DictConfig, agree: Optional[Callable] = None,
                log: Optional[Callable[[str], None]] = None) -> HostBudget:
    """The host memory a run plans with: `hardware.host_mem_gib` when set (> 0); for `plan=true` with another
    machine's profile, the profile's `profile_host_mem_gib` (the host that profile was measured on) when it has one;
    else this machine's, measured (`measure_host_memory_gib`). `agree`: makes the ranks of a data-parallel run plan
    with one figure (rank 0's; each measures a slightly different availability), `DataParallel.broadcast`. `log`
    gets one line naming the figure and where it comes from."""
    hw = cfg.hardware
    if hw.host_mem_gib > 0:
        budget = HostBudget(hw.host_mem_gib, "hardware.host_mem_gib")
    elif cfg.plan and hw.profile_host_mem_gib > 0 and not describes_this_machine(hw.name):
        budget = HostBudget(hw.profile_host_mem_gib, f"hardware.profile_host_mem_gib of hardware={hw.name}, the host "
                                                     "it was measured on (planned from another machine)")
    else:
        budget = HostBudget(*measure_host_memory_gib())
    if agree is not None:
        budget = agree(budget)
    if log is not None:
        log(f"host memory: {budget:.1f} GiB ({budget.source}); hardware.host_mem_gib=<GiB> sets it")
    return budget
