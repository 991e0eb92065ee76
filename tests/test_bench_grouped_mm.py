"""bench/bench_grouped_mm.py on the CPU (--dry-run): its routings and rows."""

import json

import torch

import bench.bench_grouped_mm as bench


def test_dry_run_writes_a_row_per_model_and_routing(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--dry-run", "--models", "gptoss20b", "--tokens", "48", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["routing"] for r in rows] == ["uniform", "skewed"]
    for r in rows:
        assert r["dry_run"] and r["rows"] == 48 * r["top_k"] and r["flops"] > 0
        for name in ("experts", "grouped", "dense", "experts_compiled"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_tflops"] > 0
        assert {"gpu", "torch", "git_sha", "date"} <= set(r)


def test_skewed_routing_gives_the_first_expert_eight_times_its_share():
    a = bench._arch("qwen3_30b_a3b", dry_run=False)
    N = 4096
    _, chosen, load = bench.routing_of(N, a, "skewed", torch, "cpu")
    assert load[0] == min(N, bench.SKEW * N * a.top_k // a.experts) and load.sum() == N * a.top_k
    assert all(len(set(row.tolist())) == a.top_k for row in chosen)  # k distinct experts a token
    _, _, uniform = bench.routing_of(N, a, "uniform", torch, "cpu")
    assert uniform.max() < 2 * N * a.top_k / a.experts
