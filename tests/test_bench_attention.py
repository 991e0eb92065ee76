"""The attention benchmark's rows: one set of columns per SDPA backend, and the backend SDPA picks by itself."""

import json

import pytest

import bench.bench_attention as bench


@pytest.mark.gpu
def test_rows_time_each_sdpa_backend_and_name_the_default(tmp_path):
    out = tmp_path / "attention.jsonl"
    assert bench.main(["--seq-lens", "1024", "--cases", "qwen7b", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["sdpa_default_choice"] in ("flash_attention", "cudnn_attention", "efficient_attention", "math")
    assert row["kernel_ms"] > 0 and row["kernel_fwd_ms"] > 0
    for backend in bench.SDPA_BACKENDS:
        assert row[f"sdpa_{backend}_note"], backend
        if row[f"sdpa_{backend}_ms"] is not None:
            assert row[f"sdpa_{backend}_fwd_ms"] > 0 and row[f"ratio_{backend}"] > 0
