"""``bos: auto`` in a recipe: the BOS token goes before each window only when the tokenizer puts it before text."""

from __future__ import annotations

import pytest

from kvquant.errors import RecipeError
from kvquant.eval.recipe import parse_recipe
from kvquant.text import window_bos


class _Tok:
    def __init__(self, bos_token_id, adds_bos):
        self.bos_token_id, self.adds_bos = bos_token_id, adds_bos

    def __call__(self, text):
        ids = [7] * len(text)
        return {"input_ids": ([self.bos_token_id] if self.adds_bos else []) + ids}


def test_auto_follows_the_tokenizer():
    assert window_bos(_Tok(2, adds_bos=True), "auto") == 2
    assert window_bos(_Tok(2, adds_bos=False), "auto") is None
    assert window_bos(_Tok(None, adds_bos=False), "auto") is None


def test_true_and_false():
    assert window_bos(_Tok(5, adds_bos=False), True) == 5
    assert window_bos(_Tok(5, adds_bos=True), False) is None
    with pytest.raises(RecipeError, match="^bos: the tokenizer has no BOS token"):
        window_bos(_Tok(None, adds_bos=False), True)


def test_recipe_accepts_auto_only_besides_booleans():
    base = {"model": "m", "data": "kjv", "configs": ["int8"]}
    assert parse_recipe({**base, "bos": "auto"}).bos == "auto"
    with pytest.raises(RecipeError, match="^bos: must be true, false or auto"):
        parse_recipe({**base, "bos": "yes"})
