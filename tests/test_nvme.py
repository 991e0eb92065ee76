"""The NVMe tier (engine/streaming/nvme.py): Adam moments of host-updated layers in a file, on CPU.

Exactness: `engine=stream` with moments on disk trains bit-identically to `engine=reference` (direct I/O and
buffered), and a unit's state taken from such an engine and loaded into another continues identically. The file
pipeline itself round-trips data through three rotating buffers. Failures stop the run with an error naming the
file: no space at preallocation, a write failing mid-run (the trainer's last checkpoint then resumes to the same
losses as an uninterrupted run), the file removed under the run. The planner moves only as many layers to disk as
the host needs, and counts them.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from engine import optim
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.streaming import nvme
from engine.streaming.nvme import MomentFile, NvmeError
from engine.trainer import Trainer
from tests.test_checkpoint import RECIPE, step_losses
from tests.test_engine_equivalence import assert_same, build, continues_identically, train
from tests.util import FP32, make_cfg


def _direct_io_works(directory) -> bool:
    probe = os.path.join(directory, ".odirect_probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def nvme_overrides(directory, n=2, direct=False):
    return [f"hardware.nvme_dir={directory}", f"engine.nvme_units={n}", f"hardware.nvme_direct_io={direct}"]


@pytest.mark.parametrize("direct", [False, True])
def test_stream_with_moments_on_disk_matches_reference(direct, tmp_path):
    if direct and not _direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    ref_rec, ref_w, ref_m, _ = train("reference", [], steps=4)
    rec, w, m, _ = train("stream", nvme_overrides(tmp_path, 2, direct), steps=4)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    # from the second step on, each record carries the previous optimizer pass's disk traffic: the moments of the
    # disk layers, each read once and written once, the same bytes every pass
    assert "nvme_read_gb" not in rec[0]
    traffic = {(r["nvme_read_gb"], r["nvme_write_gb"]) for r in rec[1:]}
    assert len(traffic) == 1 and len({*traffic.pop()}) == 1
    assert all(r["nvme_read_gbps"] > 0 and r["nvme_write_gbps"] > 0 and r["nvme_read_s"] > 0 for r in rec[1:])
    assert [r["grad_norm"] for r in rec] == [r["grad_norm"] for r in ref_rec]
    assert_same(w, ref_w)
    assert_same(m, ref_m)  # read back from the file
    assert not list(tmp_path.glob("streamtrain-moments-*")), "the tier's file is removed when the engine closes"


def test_unit_state_round_trip_through_the_file(tmp_path):
    cfg, a, data = build("stream", nvme_overrides(tmp_path, 3))
    _, b, _ = build("stream", [*nvme_overrides(tmp_path, 1), "seed=7"])
    assert a.disk_units == [1, 2, 3] and b.disk_units == [3]
    continues_identically(a, b, data, cfg.train)


def test_file_pipeline_round_trips_through_rotating_buffers(tmp_path):
    """Seven units of odd sizes through three buffers, in update order, twice; every unit reads back what was
    last written to it."""
    numels = {u: 1000 + 37 * u for u in range(1, 8)}
    f = MomentFile(str(tmp_path), numels, direct_io=_direct_io_works(tmp_path))
    try:
        assert os.path.getsize(f.path) == nvme.file_bytes(list(numels.values()))
        for rnd in range(2):
            f.prefetch(1)
            for u in numels:
                m, v = f.acquire(u)
                if rnd == 0:
                    assert not m.any() and not v.any(), "a fresh file reads as zeros"
                else:
                    assert torch.equal(m, torch.full_like(m, u)) and torch.equal(v, torch.full_like(v, -u))
                if u + 1 in numels:
                    f.prefetch(u + 1)
                m.fill_(u)
                v.fill_(-u)
                f.release(u)
            f.drain()
        m, v = f.read_copy(4)
        assert torch.equal(m, torch.full((numels[4],), 4.0)) and torch.equal(v, torch.full((numels[4],), -4.0))
        stats = f.take_io_stats()  # two passes over every unit, then unit 4 once more; the totals reset
        file_gb = nvme.file_bytes(list(numels.values())) / 1e9
        assert stats["nvme_write_gb"] == pytest.approx(2 * file_gb, rel=1e-12)
        assert stats["nvme_read_gb"] == pytest.approx(2 * file_gb + nvme.file_bytes([numels[4]]) / 1e9, rel=1e-12)
        assert stats["nvme_read_gbps"] == pytest.approx(stats["nvme_read_gb"] / stats["nvme_read_s"])
        assert f.take_io_stats() == {}
    finally:
        f.close()
    assert not f.path.exists()


def test_no_space_is_refused_before_training(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NvmeError, match=r"hardware.nvme_dir=.*cannot reserve .* GiB .*No space left on device.* "
                                        r"GiB are free there"):
        build("stream", nvme_overrides(tmp_path, 2))
    assert not list(tmp_path.glob("streamtrain-moments-*"))


def test_write_failure_stops_the_run_and_the_last_checkpoint_resumes(tmp_path, monkeypatch):
    """The third optimizer pass's write fails (disk full): the run stops with the file and unit named; resuming from
    the last checkpoint (step 2) gives the losses of a run that never failed."""
    recipe = [*RECIPE, "engine=stream", "train.steps=4", "train.checkpoint_every=1", "train.keep_checkpoints=0",
              *nvme_overrides(tmp_path, 2)]
    clean = Trainer(make_cfg(recipe), tmp_path / "clean")
    clean.run()
    real_pwritev, writes = os.pwritev, []

    def failing(fd, buffers, offset):
        writes.append(offset)
        if len(writes) > 4:  # two disk layers per pass: the third pass fails
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", failing)
    failed = Trainer(make_cfg(recipe), tmp_path / "failed")
    with pytest.raises(NvmeError, match=r"writing the Adam moments of unit \d .*streamtrain-moments-.*No space"):
        failed.run()
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    ckpts = tmp_path / "failed" / "checkpoints"
    assert (ckpts / "step_2").is_dir()
    resumed = Trainer(make_cfg([*recipe, f"train.resume={ckpts / 'step_2'}"]), tmp_path / "resumed")
    resumed.run()
    assert step_losses(tmp_path / "resumed")[0] == [s for s in step_losses(tmp_path / "clean")[0] if s[0] > 2]


def test_file_removed_under_the_run_is_an_error(tmp_path):
    cfg, eng, data = build("stream", nvme_overrides(tmp_path, 2))
    t = cfg.train
    try:
        batch = [data.batch("train", j, 2) for j in range(3)]
        eng.train_step(batch, optim.lr_at(0, t))
        eng.wait_for_optimizer()
        os.unlink(eng.nvme.path)
        eng.train_step(batch, optim.lr_at(1, t))
        with pytest.raises(NvmeError, match="was removed while the run used it"):
            eng.wait_for_optimizer()
    finally:
        eng.pending = None
        eng.close()


def test_planner_moves_only_the_layers_the_host_needs(tmp_path):
    """qwen14b in fp32 on the H200 profile: refused on the host alone with the gradients held (a norm pass, which
    holds only the host-updated units', fits there); with 60 GiB of disk it fits holding them, the moments of the
    last host-updated layers on disk (not the head), the host within its budget."""
    common = ["model=qwen14b", "hardware=h200", "plan=true", "engine=stream", "train=bench", *FP32]
    cfg = make_cfg([*common, "engine.norm_pass=off"])
    spec = ModelSpec(cfg.model)
    alone = build_plan(spec, cfg, cfg.hardware.gpu_mem_gib, 125.0, on_gpu=True, check=False)
    assert "host memory" in alone.problem()
    cfg = make_cfg(common)
    norm_pass = build_plan(spec, cfg, cfg.hardware.gpu_mem_gib, 125.0, on_gpu=True, check=False)
    assert not norm_pass.problem() and norm_pass.placement.norm_pass
    cfg = make_cfg([*common, f"hardware.nvme_dir={tmp_path}", "hardware.nvme_gib=60", "hardware.nvme_gbps=2"])
    plan = build_plan(spec, cfg, cfg.hardware.gpu_mem_gib, 125.0, on_gpu=True)
    n = plan.placement.nvme_units
    assert n > 0 and not plan.problem()
    disk = plan.placement.disk_units
    assert disk[-1] == spec.num_layers and len(disk) == n
    assert plan.total("nvme") == nvme.file_bytes([spec.units[u].layout.numel for u in disk]) <= 60 * 2**30
    fewer = build_plan(spec, make_cfg([*common, f"hardware.nvme_dir={tmp_path}", "hardware.nvme_gib=60",
                                       "hardware.nvme_gbps=2", f"engine.nvme_units={n - 1}",
                                       *[f"engine.{k}={plan.placement.as_dict()[k]}" for k in
                                         ("gpu_resident_units", "gpu_streamed_units", "recompute_group",
                                          "keep_activation_layers")]]),
                       cfg.hardware.gpu_mem_gib, 125.0, on_gpu=True, check=False)
    assert "host memory" in fewer.problem(), "one layer fewer on disk does not fit: the planner took the fewest"
    assert plan.times_s["host_adamw"] >= 2 * plan.total("nvme") / 2e9, "the tier's I/O is in the time model"


def test_nvme_units_need_a_directory_and_fp32_state():
    with pytest.raises(Exception, match="needs hardware.nvme_dir"):
        make_cfg(["engine=stream", "engine.nvme_units=2"])
    with pytest.raises(Exception, match="the NVMe tier holds the fp32 moments"):
        make_cfg(["engine=stream", "engine.nvme_units=2", "hardware.nvme_dir=/tmp", "train.master_dtype=bf16",
                  "train.moments_dtype=bf16"])


def test_files_of_dead_runs_are_removed_and_logged(tmp_path):
    """A run killed before closing leaves its file; the next run in the directory deletes files whose process is
    gone, keeps those of live processes, and says so in its notes (the run log)."""
    dead = subprocess_pid_that_exited()
    stale = tmp_path / f"{nvme.FILE_PREFIX}{dead}-deadbeef.bin"
    live = tmp_path / f"{nvme.FILE_PREFIX}{os.getppid()}-cafecafe.bin"
    for p in (stale, live):
        p.write_bytes(b"x" * 4096)
    _, eng, _ = build("stream", nvme_overrides(tmp_path, 2))
    try:
        assert not stale.exists() and live.exists()
        assert any(str(stale) in note for note in eng.notes)
        assert any("NVMe tier: the Adam moments of layers 2..3" in note for note in eng.notes)
    finally:
        eng.close()


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)
