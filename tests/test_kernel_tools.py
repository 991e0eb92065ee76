"""bench/sass_count.py and bench/ablate_adamw_update.py: the update-kernel tools that run (or prepare) without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import streamtrain_kernels.adamw_update as A

ROOT = Path(__file__).resolve().parent.parent


def test_int8_kernel_compiles_for_sm90_within_its_register_cap():
    from bench import sass_count

    if not (sass_count.nvidia_tools_dir() / "nvdisasm").exists():
        pytest.skip(f"no nvdisasm in {sass_count.nvidia_tools_dir()}: this triton wheel lacks the NVIDIA backend")
    out = subprocess.run([sys.executable, "-m", "bench.sass_count", "--formats", "bf16/int8,fp32/fp32", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    int8, fp32 = (json.loads(line) for line in out.stdout.splitlines())
    assert int8["elements_per_thread"] == 8 and fp32["elements_per_thread"] == 8
    assert 0 < int8["registers"] <= A.MAX_REGISTERS_INT8  # the launch's cap reaches the compiled kernel
    for row in (int8, fp32):
        assert row["ops"]["MUFU.RSQ"] >= 8  # sqrt_rn's fast path, once per element a thread holds
        assert 40 < row["instructions"] / 8 < 400
    assert int8["instructions"] > fp32["instructions"]  # decoding and encoding the 8-bit codes costs instructions


def test_every_ablation_variant_still_applies_and_loads(tmp_path):
    """bench/ablate_adamw_update.py patches the kernel's source by text: each patch must still find its text, and
    each patched module must import, or the GPU call that times them would fail."""
    from bench import ablate_adamw_update as ab

    base = tmp_path / "base" / "streamtrain_kernels"
    base.mkdir(parents=True)
    (base / "adamw_update.py").write_text(ab.SOURCE.read_text())
    sources = ab.variant_sources(list(ab.VARIANTS), tmp_path / "base")
    assert set(sources) == set(ab.VARIANTS) | {"base"}
    for name, (_, text) in sources.items():
        assert (text == ab.SOURCE.read_text()) == (name in ("shipped", "base"))
        assert callable(ab.load(name, text).adamw_update)
    with pytest.raises(SystemExit, match="unknown variant"):
        ab.variant_sources(["nope"], None)
