"""bench/ as a tool: its scripts import as modules of the repository root, and bench/gpu_session.sh's stage table
names only modules, grids, test paths and configs that exist (checked through its --dry-run, which runs nothing)."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_engine import GRIDS

ROOT = Path(__file__).resolve().parent.parent
SESSION = ROOT / "bench" / "gpu_session.sh"


def session(*args, cwd=ROOT):
    return subprocess.run(["bash", str(SESSION), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": "/tmp/out"})


def stage_names():
    proc = session("--list")
    assert proc.returncode == 0, proc.stderr
    return [line.split()[0] for line in proc.stdout.splitlines()]


def dry_run_commands(*stages, cwd=ROOT):
    proc = session("--dry-run", *stages, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith(("timeout", "env", "setsid"))]


def check_command(argv):
    """Every module, grid, pytest path and Hydra config a command names exists in this tree."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i - 1] == "python3":
            module = argv[i + 1]
            if module != "pytest":
                assert importlib.util.find_spec(module) is not None, module
        if arg == "--grid":
            assert argv[i + 1] in GRIDS, argv[i + 1]
    if "pytest" in argv:
        paths = [a for a in argv[argv.index("pytest") + 1:] if a.startswith("tests")]
        assert paths and all((ROOT / p).exists() for p in paths), paths
    if "train.py" in argv:
        for arg in argv:
            group = re.match(r"\+?(experiment|sweep)=(\w+)$", arg)
            if group:
                assert (ROOT / "conf" / group[1] / f"{group[2]}.yaml").exists(), arg


def test_every_bench_script_imports_as_a_module():
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("bench/peers/*.py")]:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        assert importlib.util.find_spec(module) is not None, module
    proc = subprocess.run([sys.executable, "-c", "import bench.kernel_bench, bench.peers.common"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_session_script_parses_and_lists_its_stages():
    assert subprocess.run(["bash", "-n", str(SESSION)], capture_output=True).returncode == 0
    names = stage_names()
    assert len(names) == len(set(names)) >= 40
    for name in names:  # named for what they measure: no issue numbers, no dates
        assert not re.search(r"(17|18|issue|20\d\d)", name), name
    assert {"tests", "calibrate", "planner_unseen", "stream_vs_reference", "kept_layers", "data_parallel"} <= set(names)


def test_an_unknown_stage_is_refused_before_anything_runs():
    proc = session("--dry-run", "tests", "planner17")
    assert proc.returncode == 2 and "unknown stage: planner17" in proc.stderr and "pytest" not in proc.stdout


@pytest.mark.parametrize("stages", [["tests", "dettests", "calibrate"], ["compare3b", "recomputeab"],
                                    ["ctxsweep", "nvmerun", "modelsize", "ctx512"], ["qualitypaths", "adamwab"]])
def test_dry_run_names_only_what_exists(stages):
    commands = dry_run_commands(*stages)
    assert commands
    for argv in commands:
        check_command(argv)


def test_every_stage_dry_runs_to_existing_modules_and_grids():
    commands = dry_run_commands(*stage_names())
    grids = {argv[argv.index("--grid") + 1] for argv in commands if "--grid" in argv}
    assert grids == set(GRIDS) - {"smoke", "reference", "stream7b", "rtx3090"}  # those four run by hand
    for argv in commands:
        check_command(argv)


def test_calibrate_stage_writes_the_cards_profile_for_later_stages():
    (argv,) = [a for a in dry_run_commands("calibrate") if "engine.calibrate" in a]
    assert argv[argv.index("--base") + 1] == "conf/hardware/h100.yaml"
    assert argv[argv.index("--width-models") + 1] == "qwen3b,qwen14b,qwen72b"


def test_base_tree_stages_run_the_base_checkout_apart(tmp_path):
    """With .whl/base.tar carried, the A/B stages run the same command in the unpacked base tree, its rows apart."""
    (tmp_path / ".whl").mkdir()
    subprocess.run(["tar", "cf", str(tmp_path / ".whl" / "base.tar"), "-T", "/dev/null"], check=True)
    proc = session("--dry-run", "recomputeab", "adamwablate", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("tar xf .whl/base.tar") == 1  # unpacked once per call
    assert "--out /tmp/out/engine_base.jsonl --workdir /tmp/bench_base" in out
    assert "ablate_adamw_update --out /tmp/out/adamw_ablation.jsonl --base-tree /tmp/base" in out


def test_moepeer_runs_the_deepspeed_peer_and_the_engine_at_one_shape():
    """Peer and engine rows are compared only at the same model, depth and tokens per step (bench_engine.add_ratios):
    the stage's truncated peer command and the grid's job agree on them; the full-depth peer (its host pre-flight's
    row) comes first; the commands' time limits add up to what the stage has in one call of the GPU machine."""
    commands = dry_run_commands("moepeer")
    full, truncated = [argv for argv in commands if "bench.peers.deepspeed_zero3" in argv]
    assert "--layers" not in full and full[full.index("--model") + 1] == "gptoss20b"

    def opt(argv, name, default=None):
        return argv[argv.index(name) + 1] if name in argv else default

    ((_, overrides),) = GRIDS["moepeer"]
    job = dict(o.split("=", 1) for o in overrides)
    assert opt(truncated, "--model") == job["model"] and opt(truncated, "--layers") == job["model.num_hidden_layers"]
    assert opt(truncated, "--micro-batch-size") == job["train.micro_batch_size"]
    assert opt(truncated, "--grad-accum") == job["train.grad_accum"]
    assert opt(truncated, "--seq-len", "4096") == job["train.seq_len"] == "4096"
    assert sum(int(argv[1]) for argv in commands if argv[0] == "timeout") <= 560
