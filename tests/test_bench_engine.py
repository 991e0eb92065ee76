"""bench/bench_engine.py's ratios: only rows of the same model, depth and tokens per step are compared, every
comparison is named after the baseline's `system`, and a failed baseline says why instead of giving a number."""

from bench import bench_engine


def _row(engine, model, tokens, tok_s, hardware="h200"):
    return {"engine": engine, "model": model, "tokens_per_step": tokens, "tokens_per_s": tok_s, "hardware": hardware}


def test_ratios_against_the_reference_and_the_peers_of_the_same_shape():
    rows = [_row("stream", "qwen7b", 65536, 11000.0), _row("reference", "qwen7b", 65536, 10000.0),
            _row("stream", "qwen7b", 16384, 9000.0), _row("stream", "qwen3b", 32768, 20000.0),
            {"job": "oom", "error": "exit 1"}]
    peers = [{"system": "all_on_gpu", "model": "qwen3b", "tokens_per_step": 32768, "tokens_per_s": 16000.0},
             {"system": "fsdp2_cpu_offload", "model": "qwen3b", "tokens_per_step": 32768, "error": "host OOM"},
             {"system": "all_on_gpu", "model": "qwen7b", "tokens_per_step": 8192, "tokens_per_s": 7000.0}]
    bench_engine.add_ratios(rows, peers)
    assert rows[0]["ratio_vs_reference"] == 1.1
    assert "ratio_vs_reference" not in rows[1] and "ratio_vs_reference" not in rows[2]
    assert not any(k.startswith("ratio_vs_all_on_gpu") for r in rows[:3] for k in r)
    assert rows[3]["ratio_vs_all_on_gpu"] == 1.25
    assert rows[3]["ratio_vs_fsdp2_cpu_offload"] is None
    assert rows[3]["ratio_vs_fsdp2_cpu_offload_why"] == "host OOM"
    assert set(rows[4]) == {"job", "error"}


def test_data_parallel_rows_scale_against_the_one_rank_row_of_the_same_tokens_per_rank():
    rows = [_row("stream", "qwen7b", 16384, 9000.0), {**_row("stream", "qwen7b", 32768, 17100.0), "ranks": 2},
            {**_row("stream", "qwen7b", 65536, 30000.0), "ranks": 2}]  # 32K per rank: no one-rank row to scale
    bench_engine.add_ratios(rows)
    assert rows[1]["scaling_vs_linear"] == 0.95
    assert "scaling_vs_linear" not in rows[0] and "scaling_vs_linear" not in rows[2]


def test_a_depth_truncated_row_is_compared_with_the_peer_at_that_depth_only():
    """gpt-oss-20b: the engine at 3 layers gets its ratio from the peer's 3-layer row, not from the full-depth row
    the peer's host pre-flight refused; a full-depth engine row of the same tokens per step gets that refusal."""
    rows = [{**_row("stream", "gptoss20b", 65536, 12000.0), "num_hidden_layers": 3},
            {**_row("stream", "gptoss20b", 65536, 10000.0), "num_hidden_layers": 24}]
    peers = [{"system": "deepspeed_zero3_offload", "model": "gptoss20b", "num_hidden_layers": 24,
              "tokens_per_step": 65536, "error": "host memory: ... needs ~526 GiB ..."},
             {"system": "deepspeed_zero3_offload", "model": "gptoss20b", "num_hidden_layers": 3,
              "tokens_per_step": 65536, "tokens_per_s": 3000.0}]
    bench_engine.add_ratios(rows, peers)
    assert rows[0]["ratio_vs_deepspeed_zero3_offload"] == 4.0 and "ratio_vs_deepspeed_zero3_offload_why" not in rows[0]
    assert rows[1]["ratio_vs_deepspeed_zero3_offload"] is None
    assert rows[1]["ratio_vs_deepspeed_zero3_offload_why"].startswith("host memory")
