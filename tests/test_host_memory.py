"""Host memory a run plans with (engine/hardware.py, host_budget): this machine's, measured from the cgroup limit or
the machine's total less what other processes use; `hardware.host_mem_gib` overrides it; a card profile's
`profile_host_mem_gib` serves only plans made for that profile's machine from another one. A refusal for host
memory names the knob and the figure planned with."""

from __future__ import annotations

import pickle
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from engine import hardware
from engine.model import ModelSpec
from engine.plan import PlanError, build_plan
from engine.trainer import Trainer
from tests.util import FP32, ROOT, SMALL, make_cfg

GIB = 2**30
KIB = 1024
RUN = [*SMALL, "data=synthetic", "train.seq_len=24", "train.micro_batch_size=2", "train.grad_accum=1",
       "train.steps=1", "train.val_every=-1"]


def _files(tmp_path: Path, *, total_gib=32.0, available_gib=20.0, rss_gib=1.0, cgroup: dict | None = None):
    """A fake /proc/meminfo, /proc/self/status and cgroup directory (`cgroup`: relative path -> text)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {int(total_gib * GIB / KIB)} kB\nMemFree:        1024 kB\n"
                       f"MemAvailable:   {int(available_gib * GIB / KIB)} kB\nBuffers:        0 kB\n")
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nVmPeak:\t 999 kB\nVmRSS:\t {int(rss_gib * GIB / KIB)} kB\n")
    cgroup_dir = tmp_path / "cgroup"
    for rel, text in (cgroup or {}).items():
        (cgroup_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (cgroup_dir / rel).write_text(text)
    cgroup_dir.mkdir(exist_ok=True)
    return {"cgroup_dir": cgroup_dir, "meminfo": meminfo, "status": status}


@pytest.mark.parametrize("cgroup, expected_gib, where", [
    # no cgroup limit: MemAvailable (20) plus this process's RSS (1), within the total
    ({}, 21.0, "this machine's 32.0 GiB per"),
    ({"memory.max": "max\n"}, 21.0, "this machine's 32.0 GiB per"),
    ({"memory/memory.limit_in_bytes": f"{2**63 - 4096}\n"}, 21.0, "this machine's 32.0 GiB per"),
    # v2: 16 GiB limit, 10 GiB used of which 2 GiB inactive page cache: 8 free + 1 of this process
    ({"memory.max": f"{16 * GIB}\n", "memory.current": f"{10 * GIB}\n",
      "memory.stat": f"anon 123\ninactive_file {2 * GIB}\nactive_file 0\n"}, 9.0, "cgroup v2 limit 16.0 GiB"),
    # v1: 24 GiB limit, 4 GiB used: the machine's 20 available are the lesser
    ({"memory/memory.limit_in_bytes": f"{24 * GIB}\n", "memory/memory.usage_in_bytes": f"{4 * GIB}\n"},
     21.0, "cgroup v1 limit 24.0 GiB"),
    # a limit above the machine's memory is no limit
    ({"memory.max": f"{64 * GIB}\n", "memory.current": f"{GIB}\n"}, 21.0, "this machine's 32.0 GiB per"),
])
def test_the_measure_reads_the_cgroup_limit_or_the_machine_less_what_others_use(tmp_path, cgroup, expected_gib,
                                                                                  where):
    gib, source = hardware.measure_host_memory_gib(**_files(tmp_path, cgroup=cgroup))
    assert gib == pytest.approx(expected_gib, abs=1e-6)
    assert where in source and f"{expected_gib:.1f} GiB of it available" in source
    assert "this process's 1.0 GiB included" in source


def test_the_measure_never_exceeds_the_ceiling_and_refuses_an_unreadable_meminfo(tmp_path):
    files = _files(tmp_path, total_gib=8.0, available_gib=7.5, rss_gib=2.0)  # 9.5 available + own > 8 total
    assert hardware.measure_host_memory_gib(**files)[0] == pytest.approx(8.0)
    files["meminfo"] = tmp_path / "missing"
    with pytest.raises(hardware.ConfigError, match="hardware.host_mem_gib"):
        hardware.measure_host_memory_gib(**files)


def test_psutil_when_installed_gives_the_machines_figures(tmp_path, monkeypatch):
    vm = types.SimpleNamespace(total=64 * GIB, available=40 * GIB)
    fake = types.SimpleNamespace(virtual_memory=lambda: vm, Process=lambda: types.SimpleNamespace(
        memory_info=lambda: types.SimpleNamespace(rss=2 * GIB)))
    monkeypatch.setitem(sys.modules, "psutil", fake)
    gib, source = hardware.measure_host_memory_gib(cgroup_dir=tmp_path)
    assert gib == pytest.approx(42.0) and "this machine's 64.0 GiB per psutil" in source


def test_no_card_profile_sets_the_users_host_memory_knob():
    """The profiles carry the host of the machine they were measured on as profile_host_mem_gib; host_mem_gib is
    the user's (a recipe that caps the run on purpose may set it)."""
    for path in sorted((ROOT / "conf" / "hardware").glob("*.yaml")):
        assert "host_mem_gib" not in OmegaConf.load(path), path.name
    assert make_cfg(["hardware=h200", "plan=true"]).hardware.profile_host_mem_gib == 125.0
    assert make_cfg(["hardware=h100x8", "plan=true"]).hardware.profile_host_mem_gib == 557.0


@pytest.fixture
def measured(monkeypatch):
    """This machine's measure, fixed: the tests must not depend on this machine's numbers."""
    monkeypatch.setattr(hardware, "measure_host_memory_gib", lambda *a, **k: (33.0, "fake measure: 33.0 GiB"),
                        raising=False)


def test_a_plan_for_another_machines_profile_uses_that_profiles_host(measured, tmp_path, capsys):
    tr = Trainer(make_cfg(["model=qwen7b", "engine=stream", "train=bench", "hardware=h200", "plan=true"]),
                 tmp_path)
    assert tr.plan.limits_gib["host"] == 125.0
    assert "profile_host_mem_gib of hardware=h200" in tr.plan.host_source
    tr.run()
    assert "host memory planned with: 125.0 GiB (hardware.profile_host_mem_gib" in capsys.readouterr().out
    over = Trainer(make_cfg(["model=qwen7b", "engine=stream", "hardware=h200", "hardware.host_mem_gib=300",
                             "plan=true"]), tmp_path)
    assert over.plan.limits_gib["host"] == 300.0 and over.plan.host_source == "hardware.host_mem_gib"


def test_a_plan_for_this_machines_profile_uses_the_measure(measured, tmp_path, monkeypatch):
    tr = Trainer(make_cfg([*RUN, "plan=true"]), tmp_path)  # hardware=cpu on a CPU machine
    assert tr.plan.limits_gib["host"] == 33.0 and tr.plan.host_source == "fake measure: 33.0 GiB"
    # on an H200 machine (as hardware=auto picks it), its own profile is this machine: measured, not 125
    monkeypatch.setattr(hardware, "detect_profile", lambda: "h200")
    tr = Trainer(make_cfg(["model=qwen7b", "engine=stream", "hardware=h200", "plan=true"]), tmp_path)
    assert tr.plan.limits_gib["host"] == 33.0


@pytest.mark.parametrize("override, host_gib, source", [([], 33.0, "fake measure: 33.0 GiB"),
                                                        (["hardware.host_mem_gib=7"], 7.0, "hardware.host_mem_gib")])
def test_a_run_plans_with_this_machines_memory_or_the_override(measured, tmp_path, capsys, override, host_gib,
                                                               source):
    tr = Trainer(make_cfg([*RUN, *override]), tmp_path)
    try:
        assert tr.plan.limits_gib["host"] == host_gib and tr.plan.host_source == source
    finally:
        tr.close()
        tr.log.close()
    line = f"host memory: {host_gib:.1f} GiB ({source}); hardware.host_mem_gib=<GiB> sets it"
    assert line in capsys.readouterr().out and line in (tmp_path / "train.log").read_text()


def test_a_data_parallel_rank_plans_with_its_share_and_the_budget_travels_whole():
    budget = hardware.HostBudget(253.0, "measured here")
    share = budget.per_rank(2)
    assert share == 126.5 and share.source == "1/2 of 253.0 GiB per rank: measured here"
    copy = pickle.loads(pickle.dumps(budget))  # as torch.distributed broadcasts rank 0's figure
    assert copy == 253.0 and copy.source == "measured here"


def test_a_host_refusal_names_the_knob_and_the_figure_planned_with(measured, tmp_path):
    """fp32 streaming of a 14B model on a 125 GiB host, the gradients held, is refused; the text says how to plan
    for the host it has."""
    cfg = make_cfg(["model=qwen14b", "engine=stream", "train=bench", "hardware=h200", "plan=true", *FP32,
                    "engine.norm_pass=off"])
    with pytest.raises(PlanError) as err:
        Trainer(cfg, tmp_path).run()
    text = str(err.value)
    assert "hardware.host_mem_gib=<GiB> plans for more host memory (this run planned with 125.0 GiB: " \
           "hardware.profile_host_mem_gib of hardware=h200" in text
    assert "train.micro_batch_size" in text  # the existing suggestions stay
    assert "hardware.gpu_mem_cap_gib" not in text
    fits = make_cfg(["model=qwen14b", "engine=stream", "train=bench", "hardware=h200", "plan=true", *FP32,
                     "hardware.host_mem_gib=1024"])
    assert not build_plan(ModelSpec(fits.model), fits, 139.0, hardware.host_budget(fits), on_gpu=True,
                          check=False).problem()


def test_a_gpu_refusal_names_the_cap_only_when_one_is_set():
    cfg = make_cfg(["model=qwen7b", "engine=reference", "hardware=h200", "plan=true"])
    spec = ModelSpec(cfg.model)
    plain = build_plan(spec, cfg, 24.0, 500.0, on_gpu=True, check=False).problem()
    assert plain and "gpu memory" in plain and "gpu_mem_cap_gib" not in plain
    capped = make_cfg(["model=qwen7b", "engine=reference", "hardware=h200", "plan=true",
                       "hardware.gpu_mem_cap_gib=24"])
    text = build_plan(spec, capped, hardware.usable_gpu_gib(capped.hardware, 0.0), 500.0, on_gpu=True,
                      check=False).problem()
    assert "hardware.gpu_mem_cap_gib=24 caps the GPU memory" in text
    assert "hardware.host_mem_gib" not in text  # the host fits
