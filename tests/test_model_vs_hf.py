"""The layer templates (engine/model) against transformers' own Qwen2 / Qwen3 / Llama implementations.

Tiny random HF models (every weight random, norms and biases included, so that no term hides behind a 1 or a 0) are
copied into our per-unit parameter dicts; then, on CPU:

* layout: our HF names, shapes and parameter count equal the HF model's (tiny models, and every published config
  of conf/model/ instantiated on the meta device);
* fp32: logits equal HF's to ~1e-5, and so does every parameter gradient of the mean next-token loss (ours through
  the chunked `loss_sum`, HF's through cross-entropy on its logits: labels are aligned with positions in both, so
  HF's internal label shift is bypassed);
* bf16 autocast with fp32 weights: our logits may be no further from the fp32 reference than twice HF's own
  autocast logits are (plus a small atol), the rule flash-attention uses to test its kernels; against HF's sdpa
  path, which runs the same ops in the same dtypes, they must agree far below that error;
* rope: llama3 inverse frequencies equal transformers' ROPE_INIT_FUNCTIONS["llama3"], and our cos/sin tables equal
  HF's rotary embedding.

Cases cover qkv bias (Qwen2), q/k norm with head_dim != hidden/heads (Qwen3), llama3 rope rescaling at a sequence
longer than original_max_position_embeddings (Llama), GQA ratios 1, 2 and 3, tied and untied embeddings, odd sizes
(intermediate 100, vocab 131, seq_len 37), and both HF attention paths (eager, sdpa).
"""

from __future__ import annotations

import functools
import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from omegaconf import OmegaConf  # noqa: E402

from engine.config import MOE_MODEL_TYPES  # noqa: E402
from engine.model import ModelSpec, dense  # noqa: E402
from tests.util import CONF_DIR, make_cfg  # noqa: E402

B = 2
LLAMA3 = ("model.rope_scaling={rope_type:llama3,factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,"
          "original_max_position_embeddings:32}")
QWEN3 = ["model.model_type=qwen3", "model.qkv_bias=false", "model.qk_norm=true"]
LLAMA = ["model.model_type=llama", "model.qkv_bias=false", "model.qk_norm=false"]

# name: (overrides on conf/model/tiny.yaml, seq_len, HF attention implementation)
CASES = {
    # Qwen2: q/k/v bias, GQA 3 (6 heads of 12, 2 kv heads), odd intermediate, vocab and seq_len.
    "qwen2_gqa3": (["model.hidden_size=72", "model.num_attention_heads=6", "model.num_key_value_heads=2",
                    "model.intermediate_size=100", "model.vocab_size=131"], 37, "eager"),
    # Qwen2 tied (as Qwen2.5-0.5B), GQA 1.
    "qwen2_tied_gqa1": (["model.hidden_size=48", "model.num_attention_heads=4", "model.num_key_value_heads=4",
                         "model.intermediate_size=100", "model.tie_word_embeddings=true"], 37, "eager"),
    # Qwen3: q/k RMSNorm, head_dim 24 != 64 / 4, GQA 2.
    "qwen3_hd24_gqa2": ([*QWEN3, "model.hidden_size=64", "model.num_attention_heads=4", "model.num_key_value_heads=2",
                         "model.head_dim=24", "model.intermediate_size=100", "model.vocab_size=131",
                         "model.rope_theta=1000000.0"], 37, "eager"),
    # Qwen3 tied (as Qwen3-0.6B), GQA 3, head_dim 16 (6 * 16 = 96 != 64).
    "qwen3_tied_gqa3": ([*QWEN3, "model.hidden_size=64", "model.num_attention_heads=6", "model.num_key_value_heads=2",
                         "model.head_dim=16", "model.intermediate_size=100", "model.tie_word_embeddings=true"],
                        37, "sdpa"),
    # Llama 3.1: llama3 rope rescaling (original 32 < seq_len 48), GQA 2.
    "llama3_gqa2": ([*LLAMA, LLAMA3, "model.hidden_size=64", "model.num_attention_heads=4",
                     "model.num_key_value_heads=2", "model.intermediate_size=100", "model.vocab_size=131",
                     "model.rms_norm_eps=1e-5"], 48, "eager"),
    # Llama 3.2 style: tied, GQA 3, llama3 rope, HF sdpa.
    "llama3_tied_gqa3": ([*LLAMA, LLAMA3, "model.hidden_size=72", "model.num_attention_heads=6",
                          "model.num_key_value_heads=2", "model.intermediate_size=100",
                          "model.tie_word_embeddings=true"], 48, "sdpa"),
    # Llama with the default rope and an odd seq_len, HF sdpa.
    "llama_default_rope_gqa1": ([*LLAMA, "model.hidden_size=64", "model.num_attention_heads=4",
                                 "model.num_key_value_heads=4", "model.intermediate_size=100"], 37, "sdpa"),
}
COMMON = ["model.num_hidden_layers=2", "model.max_position_embeddings=128", "train.seq_len=32"]


# --------------------------------------------------------------------------------------------------------- helpers

def _plain(x):
    """OmegaConf node -> plain python (dicts for rope_scaling)."""
    if x is None or isinstance(x, (int, float, str, bool)):
        return x
    return {k: _plain(v) for k, v in x.items()}


def hf_config(m, attn: str = "eager"):
    """The transformers config describing our model config `m` (both the v5 `rope_parameters` and v4 API)."""
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    kw = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
              num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
              num_key_value_heads=m.num_key_value_heads, head_dim=head_dim,
              max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps,
              tie_word_embeddings=m.tie_word_embeddings, hidden_act="silu", attn_implementation=attn)
    if m.model_type == "qwen2":
        # HF's Qwen2 always has q/k/v biases and no q/k norm.
        assert m.qkv_bias and not m.qk_norm, "HF Qwen2 is qkv_bias=true, qk_norm=false"
        cfg_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    elif m.model_type == "qwen3":
        # HF's Qwen3 always has q/k norm; its attention_bias would also put a bias on o_proj, which ours lacks.
        assert m.qk_norm and not m.qkv_bias, "HF Qwen3 is qk_norm=true, qkv_bias=false"
        cfg_cls, model_cls = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
        kw["attention_bias"] = False
    else:
        # HF's Llama attention_bias would also put a bias on o_proj, which our templates do not have.
        assert m.model_type == "llama" and not m.qk_norm and not m.qkv_bias
        cfg_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
        kw.update(attention_bias=False, mlp_bias=False)
    scaling = _plain(m.rope_scaling)
    if "rope_parameters" in inspect.signature(cfg_cls.__init__).parameters:  # transformers >= 5
        kw["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": float(m.rope_theta)}
    else:
        kw.update(rope_theta=float(m.rope_theta), rope_scaling=scaling)
    return cfg_cls(**kw), model_cls


@functools.lru_cache(maxsize=None)
def case_cfg(case: str):
    overrides, seq_len, attn = CASES[case]
    cfg = make_cfg([*COMMON, *overrides])
    return cfg.model, seq_len, attn


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every tensor random and O(1)-scaled activations: embeddings N(0, 0.5^2), matrices N(0, 1/fan_in), norm weights
    1 + N(0, 0.2^2), biases N(0, 0.1^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding: yielded once
            if name.endswith("embed_tokens.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


@functools.lru_cache(maxsize=None)
def hf_model(case: str):
    m, _, attn = case_cfg(case)
    config, model_cls = hf_config(m, attn)
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    _randomize(model, torch.Generator().manual_seed(1234))
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def our_params(spec: ModelSpec, model) -> list[dict]:
    """Per-unit dicts of fp32 leaf tensors (requires_grad) copied from the HF state dict."""
    sd = model.state_dict()
    return [{s.name: sd[u.layout.prefix + s.name].detach().clone().float().requires_grad_(True)
             for s in u.layout.specs} for u in spec.units]


def our_hidden(spec: ModelSpec, params: list[dict], ids_BT: torch.Tensor) -> torch.Tensor:
    x = spec.embed(params[0], ids_BT)
    rope = spec.positions(ids_BT.shape[1], "cpu")
    for u in spec.layer_units:
        x = spec.layer(params[u.index], x, rope, u.layer)
    return x


def tied_weight(spec: ModelSpec, params: list[dict]):
    return params[0][spec.tied_weight_name] if spec.tied else None


def our_logits(spec, params, ids_BT):
    return dense.logits(params[-1], our_hidden(spec, params, ids_BT), spec.arch, tied_weight(spec, params))


def inputs(m, seq_len: int, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.vocab_size, (B, seq_len), generator=gen)
    labels = torch.randint(0, m.vocab_size, (B, seq_len), generator=gen)
    labels[0, :3] = -100  # ignored positions count in neither the sum nor n
    labels[1, -2:] = -100
    return ids, labels


def assert_close_scaled(name: str, ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """max |ours - ref| <= rel * max |ref| (+ a floor for all-but-zero tensors)."""
    assert ours.shape == ref.shape, name
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale + 1e-12, f"{name}: max abs err {err:.3e} > {rel:g} * max |ref| {scale:.3e}"


# ---------------------------------------------------------------------------------------------------------- layout

@pytest.mark.parametrize("case", CASES)
def test_layout_matches_hf(case):
    m, _, _ = case_cfg(case)
    spec = ModelSpec(m)
    model = hf_model(case)
    _assert_layout(spec, model)


def _assert_layout(spec: ModelSpec, model) -> None:
    ours = {u.layout.prefix + s.name: tuple(s.shape) for u in spec.units for s in u.layout.specs}
    assert [u.layout.prefix + s.name for u in spec.units for s in u.layout.specs] == list(ours)  # no duplicates
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if spec.tied:  # HF may or may not list the tied lm_head in its state dict; it is the embedding either way
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        sd.pop("lm_head.weight", None)
    assert set(ours) == set(sd), (f"only ours: {sorted(set(ours) - set(sd))}; "
                                  f"only HF: {sorted(set(sd) - set(ours))}")
    assert ours == sd
    assert spec.num_params() == sum(p.numel() for p in model.parameters())  # parameters() yields tied once


PUBLISHED = sorted(p.stem for p in Path(CONF_DIR, "model").glob("*.yaml")  # MoE files: tests/test_moe_vs_hf.py
                   if OmegaConf.load(p).model_type not in MOE_MODEL_TYPES)


@pytest.mark.parametrize("name", PUBLISHED)
def test_layout_matches_hf_published_configs(name):
    """Every conf/model/*.yaml describes what transformers builds from the same fields (on the meta device, no
    memory), and its expected_params (where given) is that model's parameter count."""
    m = make_cfg([f"model={name}"]).model
    spec = ModelSpec(m)
    config, model_cls = hf_config(m)
    with torch.device("meta"):
        model = model_cls(config)
    _assert_layout(spec, model)
    if m.expected_params is not None:
        assert sum(p.numel() for p in model.parameters()) == m.expected_params


# ------------------------------------------------------------------------------------------------------------ fp32

@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf_fp32(case):
    m, seq_len, _ = case_cfg(case)
    spec, model = ModelSpec(m), hf_model(case)
    ids, _ = inputs(m, seq_len)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        ours = our_logits(spec, our_params(spec, model), ids)
    assert ours.dtype == torch.float32 and ours.shape == (B, seq_len, m.vocab_size)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_grads_match_hf_fp32(case, monkeypatch):
    m, seq_len, _ = case_cfg(case)
    spec, model = ModelSpec(m), hf_model(case)
    ids, labels = inputs(m, seq_len)
    n = int((labels != -100).sum())

    hf_named = dict(model.named_parameters())  # tied: the embedding only
    logits = model(input_ids=ids).logits
    hf_loss = F.cross_entropy(logits.float().reshape(-1, m.vocab_size), labels.reshape(-1), reduction="sum") / n
    hf_grads = dict(zip(hf_named, torch.autograd.grad(hf_loss, list(hf_named.values()))))

    # Force several loss chunks, the last one partial (B * seq_len is not a multiple of 10).
    monkeypatch.setattr(dense, "LOSS_CHUNK_ELEMS", 10 * m.vocab_size)
    params = our_params(spec, model)
    loss = spec.loss_sum(params[-1], our_hidden(spec, params, ids), labels, tied_weight(spec, params)) / n
    ours = [t for p in params for t in p.values()]
    our_grads = dict(zip([u.layout.prefix + s.name for u in spec.units for s in u.layout.specs],
                         torch.autograd.grad(loss, ours)))

    torch.testing.assert_close(loss, hf_loss.detach(), atol=1e-5, rtol=1e-5)
    assert set(our_grads) == set(hf_grads)
    for name, g in hf_grads.items():
        assert g.abs().max() > 0, name
        assert_close_scaled(name, our_grads[name], g, rel=1e-5)


# ------------------------------------------------------------------------------------------------------------ bf16

@pytest.mark.parametrize("case", CASES)
def test_logits_bf16_autocast_within_hf_error(case):
    """fp32 weights under CPU bf16 autocast: our deviation from the fp32 logits is at most twice HF's own."""
    m, seq_len, attn = case_cfg(case)
    spec, model = ModelSpec(m), hf_model(case)
    ids, _ = inputs(m, seq_len)
    params = our_params(spec, model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hf_bf16 = model(input_ids=ids).logits.float()
            ours_bf16 = our_logits(spec, params, ids).float()
    # the residual stream stays fp32 under autocast, as in transformers
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert our_hidden(spec, params, ids).dtype == torch.float32
    scale = ref.abs().max().item()
    hf_err = (hf_bf16 - ref).abs().max().item()
    our_err = (ours_bf16 - ref).abs().max().item()
    assert hf_err > 0  # autocast really ran in bf16
    assert our_err <= 2 * hf_err + 1e-3 * scale, f"ours {our_err:.3e} vs HF {hf_err:.3e} (max |ref| {scale:.3e})"
    hf_rms = (hf_bf16 - ref).pow(2).mean().sqrt().item()
    our_rms = (ours_bf16 - ref).pow(2).mean().sqrt().item()
    assert our_rms <= 2 * hf_rms + 1e-4 * scale, f"rms: ours {our_rms:.3e} vs HF {hf_rms:.3e}"
    if attn == "sdpa":
        # Against HF's sdpa path the ops and their dtypes are the same (fp32 residual and RMSNorm, fp32 rope, bf16
        # linears and attention), so the outputs agree far below the bf16 error itself (on CPU: bit for bit). The 2x
        # rule above cannot see a precision-policy slip (RMSNorm or rope in bf16, a bf16 residual: ~1.3x HF's
        # error); this does.
        diff = (ours_bf16 - hf_bf16).abs().max().item()
        assert diff <= 0.05 * hf_err, f"ours vs HF autocast: {diff:.3e} (HF's own bf16 error {hf_err:.3e})"


# ------------------------------------------------------------------------------------------------------------ rope

@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("llama3")] + ["qwen3_hd24_gqa2"])
def test_rope_tables_match_hf(case):
    m, seq_len, _ = case_cfg(case)
    spec, model = ModelSpec(m), hf_model(case)
    rope = spec.positions(seq_len, "cpu")
    rotary = model.model.rotary_emb
    x = torch.zeros(1, seq_len, m.hidden_size)
    cos, sin = rotary(x, torch.arange(seq_len)[None])
    torch.testing.assert_close(rope.cos, cos[0].float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rope.sin, sin[0].float(), atol=1e-6, rtol=1e-6)


LLAMA3_ROPES = {
    # the tiny test models: head_dim 16 / 12, original 32 (all three regimes: kept, blended, divided by factor)
    "tiny16": (16, 10000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32)),
    "tiny12": (12, 10000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32)),
    # Llama 3.1 8B/70B and Llama 3.2 (factor 32) as published
    "llama3.1": (128, 500000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)),
    "llama3.2": (64, 500000.0, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)),
}


@pytest.mark.parametrize("name", LLAMA3_ROPES)
def test_llama3_inv_freq_matches_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.rope import inv_freq

    head_dim, theta, params = LLAMA3_ROPES[name]
    scaling = {"rope_type": "llama3", **params}
    m = make_cfg(["model.model_type=llama", "model.qkv_bias=false", f"model.hidden_size={head_dim * 2}",
                  "model.num_attention_heads=2", "model.num_key_value_heads=2", f"model.rope_theta={theta}",
                  "model.max_position_embeddings=131072", "model.rope_scaling={rope_type:llama3,"
                  + ",".join(f"{k}:{v}" for k, v in params.items()) + "}"]).model
    config, _ = hf_config(m)
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0  # our tables carry no cos/sin scaling
    ours = inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(ours, ref.float(), atol=0.0, rtol=1e-6)
    # the rescale really does something here, in all three bands
    plain = inv_freq(head_dim, theta, None)
    ratio = ours / plain
    factor = params["factor"]
    assert (ratio == 1.0).any() and torch.isclose(ratio, torch.tensor(1 / factor)).any()
    if name == "tiny16":
        assert ((ratio < 1.0) & (ratio > 1 / factor + 1e-6)).any()
