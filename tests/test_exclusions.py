"""Every exclusion rule (kvquant.exclusions.RULES) is checked, and reported where it applies: a config-wide rule
as a one-line ConfigError when the config is made, a layer rule when the cache's plan is resolved (an error, or
a warning naming the option and the layers that do not get it, and the option really off in those layers)."""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig

from kvquant import KVQuantConfig, ModelShape
from kvquant.errors import ConfigError
from kvquant.exclusions import RULES
from kvquant.plan import resolve

SHAPE = ModelShape(2, 2, 64)

# rule (feature, scope, action, first words of its reason) -> a config dict it applies to, and the model
CASES = {
    ("ladder_tokens", "config", "not supported together with offload"):
        {"default": "tq4", "ladder_tokens": 8, "offload": {"device": "cpu"}},
    ("heavy_tokens", "config", "not supported together with offload"):
        {"default": "tq4", "heavy_tokens": 8, "offload": {"device": "cpu"}},
    ("ladder_tokens", "config", "not supported together with evict"):
        {"default": "tq4", "ladder_tokens": 8, "evict": {"policy": "snapkv", "keep": 0.5}},
    ("heavy_tokens", "config", "not supported together with evict"):
        {"default": "tq4", "heavy_tokens": 8, "evict": {"policy": "snapkv", "keep": 0.5}},
    ("offload", "config", "not supported together with evict"):
        {"default": "int8", "offload": {"device": "cpu"}, "evict": {"policy": "snapkv", "keep": 0.5}},
    ("residual_step", "config", "{f.residual_step} with evict.budget adakv"):
        {"default": "int4", "residual_tokens": 32, "residual_step": 4,
         "evict": {"policy": "snapkv", "keep": 0.5, "budget": "adakv"}},
    ("evict.policy", "config", "h2o / tova replace single tokens"):
        {"default": "int4-channel", "evict": {"policy": "h2o", "keep": 0.5}},
    ("residual_step", "layer", "{f.residual_step} must be block_size"):
        {"default": "int8", "layers": {1: "int4-channel"}, "residual_tokens": 32, "residual_step": 4},
    ("center_keys", "layer", "key centering is exact only"): {"default": "int8", "center_keys": True},
    ("softcap", "layer", "codebook (tq*) keys remove"): {"default": "tq4"},
    ("evict", "layer", "a sliding-window layer keeps"): {"default": "int8", "evict": {"policy": "snapkv", "keep": 0.5}},
    ("ladder_tokens", "layer", "a sliding-window layer drops old rows"): {"default": "tq4", "ladder_tokens": 8},
    ("ladder_tokens", "layer", "no K or V of the layer"): {"default": "int8", "layers": {0: "tq4"}, "ladder_tokens": 8},
    ("ladder2_tokens", "layer", "the second rung refines"):
        {"default": "int8", "layers": {0: "tq4"}, "ladder_tokens": 8, "ladder2_tokens": 4},
    ("heavy_tokens", "layer", "a sliding-window layer drops the prompt"): {"default": "tq4", "heavy_tokens": 8},
    ("heavy_tokens", "layer", "no K or V of the layer"): {"default": "int8", "layers": {0: "tq4"}, "heavy_tokens": 8},
}

SOFTCAP = {"center_keys", "softcap"}  # rules about the model's logit softcap: a Gemma-2-like config
SLIDING = {"a sliding-window layer"}  # rules about sliding-window layers: layer 1 slides


def _key(rule):
    return next(k for k in CASES if k[:2] == (rule.feature, rule.scope) and rule.why.startswith(k[2]))


def _model(key):
    softcap = key[0] in SOFTCAP
    sliding = any(key[2].startswith(s) for s in SLIDING)
    extra = {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]} if sliding else {}
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=128, **extra)
    if softcap:
        cfg.attn_logit_softcapping = 30.0
    return cfg


def test_every_rule_has_a_case():
    """A rule added to the table without a case here fails (and a case without its rule)."""
    assert sorted(_key(r) for r in RULES) == sorted(CASES)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.scope}-{r.feature}-{r.why[:24]}")
def test_rule_is_reported(rule):
    key = _key(rule)
    raw = CASES[key]
    if rule.scope == "config":
        with pytest.raises(ConfigError, match=f"^{rule.feature}: "):
            KVQuantConfig.from_dict(raw)
        return
    config = KVQuantConfig.from_dict(raw)
    model = _model(key)
    if rule.action == "error":
        with pytest.raises(ConfigError, match=f"^{rule.feature}: "):
            resolve(config, model)
        return
    plan = resolve(config, model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan.report()
    lines = [str(w.message) for w in seen if str(w.message).startswith(f"{rule.feature}: not on layer")]
    assert lines, f"{rule.feature}: the drop was not reported ({[str(w.message) for w in seen]})"
    dropped = [lp for lp in plan.layers if rule in lp.dropped]
    assert dropped, "no layer records the rule it dropped"
    for lp in dropped:
        assert str(lp.index) in lines[0]
        value = {"evict": lp.evict, "ladder_tokens": lp.ladder_tokens, "ladder2_tokens": lp.ladder2_tokens,
                 "heavy_tokens": lp.heavy_tokens}[rule.feature]
        assert not value, f"layer {lp.index} still gets {rule.feature}"
    kept = [lp for lp in plan.layers if not lp.dropped]
    assert kept, "the case should keep the option on some layer (a drop, not a refusal)"


def test_a_layer_that_can_take_an_option_keeps_it():
    """The plan passes an option through where no rule applies (no warning, the value as configured)."""
    config = KVQuantConfig.from_dict({"default": "tq4", "ladder_tokens": 8, "ladder2_tokens": 4, "heavy_tokens": 8,
                                      "sink_tokens": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = resolve(config, SHAPE)
        plan.report()
    for lp in plan.layers:
        assert (lp.ladder_tokens, lp.ladder2_tokens, lp.heavy_tokens, lp.sink_tokens) == (8, 4, 8, 2)
        assert lp.dropped == ()
