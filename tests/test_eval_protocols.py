"""The evaluation protocols on the real stories260K model with TinyStories text (from the shared folder)."""

from __future__ import annotations

import pytest
import torch

from kvquant.eval.baselines import ReferenceMethod, make_method
from kvquant.eval.metrics import summarize
from kvquant.eval.protocols import decode_logits, simulated_logits
from kvquant.text import token_windows, tokenize
from kvquant.transformers_compat import cache_kw

WINDOW, PREFILL, CHUNK = 96, 32, 8


@pytest.fixture(scope="module")
def windows(stories, tinystories_text):
    _, tok = stories
    ids = tokenize(tinystories_text, tok)
    return {
        "simulated": token_windows(ids, WINDOW, max_windows=2, bos_id=tok.bos_token_id),
        "decode": token_windows(ids, WINDOW, max_windows=2, bos_id=tok.bos_token_id, min_score_from=PREFILL + 1),
    }


def _score(model, method, protocol, windows):
    logits, targets = [], []
    for w in windows[protocol]:
        if protocol == "decode":
            sc = decode_logits(model, w, method.decode_cache(model), PREFILL, CHUNK)
        else:
            sc = simulated_logits(model, w, method.simulated_cache(model))
        if method.uses_kvquant_attention:
            model.set_attn_implementation("sdpa")
        logits.append(sc.logits)
        targets.append(sc.targets)
    return torch.cat(logits), torch.cat(targets)


@pytest.fixture(scope="module", autouse=True)
def _shared_model_keeps_its_attention(stories):
    """The scoring below switches the shared model to SDPA; later modules get it back as they found it."""
    model, _ = stories
    impl = model.config._attn_implementation
    yield
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)


@pytest.fixture(scope="module")
def reference(stories, windows):
    model, _ = stories
    return {p: _score(model, ReferenceMethod(), p, windows) for p in ("simulated", "decode")}


@pytest.mark.parametrize("protocol", ["simulated", "decode"])
def test_reference_against_itself_is_exactly_zero(stories, windows, reference, protocol):
    model, _ = stories
    ref_logits, targets = reference[protocol]
    again, t2 = _score(model, ReferenceMethod(), protocol, windows)
    assert torch.equal(targets, t2)
    s = summarize(ref_logits, again, targets)
    assert s["kl_mean"] == 0.0 and s["kl_p99"] == 0.0 and s["kl_max"] == 0.0
    assert s["top1"] == 1.0
    assert s["delta_ppl"] == 0.0
    assert s["mean_abs_dp"] == 0.0
    # scored targets: every window after its first position (simulated) or after the prefill (decode)
    expected = 2 * ((WINDOW - 1) if protocol == "simulated" else (WINDOW - PREFILL - 1))
    assert s["n_tokens"] == expected


def test_fp32_passthrough_simulated_is_exact(stories, windows, reference):
    """An fp32 model stored as fp32 is not quantized at all: the simulated protocol must give 0 exactly."""
    model, _ = stories
    ref_logits, targets = reference["simulated"]
    q, _ = _score(model, make_method("fp32"), "simulated", windows)
    s = summarize(ref_logits, q, targets)
    assert s["kl_mean"] == 0.0 and s["top1"] == 1.0 and s["delta_ppl"] == 0.0


@pytest.mark.parametrize("protocol", ["simulated", "decode"])
def test_int8_drifts_less_than_int4(stories, windows, reference, protocol):
    model, _ = stories
    ref_logits, targets = reference[protocol]
    kl = {}
    for name in ("int8", "int4"):
        q, _ = _score(model, make_method(name), protocol, windows)
        kl[name] = summarize(ref_logits, q, targets)["kl_mean"]
    assert 0.0 < kl["int8"] < kl["int4"]


def test_decode_protocol_sees_hqq_int4_quantization(stories, windows, reference):
    model, _ = stories
    ref_logits, targets = reference["decode"]
    q, _ = _score(model, make_method("hf-hqq-int4"), "decode", windows)
    s = summarize(ref_logits, q, targets)
    assert s["kl_mean"] > 1e-4
    assert s["top1"] < 1.0


def test_single_forward_through_transformers_quantized_cache_measures_nothing(stories, windows):
    """Why the simulated protocol round-trips baselines: QuantizedCache's first call returns unquantized K/V."""
    from transformers import DynamicCache, QuantizedCache

    model, _ = stories
    ids = windows["simulated"][0].ids.unsqueeze(0)
    with torch.no_grad():
        ref = model(ids, **cache_kw(DynamicCache(config=model.config)), use_cache=True).logits
        naive = model(ids, **cache_kw(QuantizedCache("hqq", model.config, nbits=4)), use_cache=True).logits
    assert torch.equal(ref, naive)


def test_simulated_protocol_sees_hqq_int4_quantization(stories, windows, reference):
    model, _ = stories
    ref_logits, targets = reference["simulated"]
    q, _ = _score(model, make_method("hf-hqq-int4"), "simulated", windows)
    assert summarize(ref_logits, q, targets)["kl_mean"] > 1e-3


def test_storage_is_measured(stories, windows):
    model, _ = stories
    w = windows["decode"][0]
    for name, lo, hi in (("int8", 7.5, 9.0), ("hf-fp8", 7.5, 8.5), ("bnb-int8", 8.0, 9.5)):
        m = make_method(name)
        if name == "hf-fp8" and m.unavailable():  # transformers before 5.22 has no fp8 QuantizedCache
            assert "no 'fp8' backend" in m.unavailable()
            continue
        cache = m.decode_cache(model)
        decode_logits(model, w, cache, PREFILL, CHUNK)
        if m.uses_kvquant_attention:
            model.set_attn_implementation("sdpa")
        st = m.storage(model, cache, int(w.ids.numel()))
        assert lo <= st.avg_bits <= hi, (name, st)


def test_simulated_static_scales_never_see_the_future(stories, windows):
    """Static int8 scales come from the prefill: the logits up to a position do not depend on later tokens."""
    from kvquant.text import Window

    model, _ = stories
    w = windows["simulated"][0]
    cut = PREFILL + 20
    other = windows["simulated"][1].ids
    changed = Window(w.index, w.start, torch.cat([w.ids[:cut], other[cut:]]), w.score_from)
    method = make_method("int8")
    keep = cut - w.score_from  # scored rows predicting targets before `cut` see only tokens before it

    def rows(window, calibrate):
        return simulated_logits(model, window, method.simulated_cache(model), calibrate=calibrate).logits[:keep]

    torch.testing.assert_close(rows(changed, PREFILL), rows(w, PREFILL), atol=1e-5, rtol=0)
    # scales over the whole window (calibrate=0) would let later tokens change earlier predictions
    assert (rows(changed, 0) - rows(w, 0)).abs().max() > 1e-3


def test_chunked_decode_is_optimistic_and_labelled(stories, windows):
    """Chunked decode (a fast mode) lets tokens inside a step see each other unquantized: for int4 it reports
    less drift than exact one-token decode on the same tokens."""
    model, _ = stories
    ref = ReferenceMethod()
    q = make_method("int4")
    out = {}
    for chunk in (1, 16):
        r, t = [], []
        for w in windows["decode"]:
            r.append(decode_logits(model, w, ref.decode_cache(model), PREFILL, chunk).logits)
            t.append(decode_logits(model, w, q.decode_cache(model), PREFILL, chunk).logits)
            model.set_attn_implementation("sdpa")
        targets = torch.cat([w.ids[w.score_from:] for w in windows["decode"]])
        out[chunk] = summarize(torch.cat(r), torch.cat(t), targets)["kl_mean"]
    assert out[16] < out[1], out
