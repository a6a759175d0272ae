"""A cache bound to token ids (prefix reuse, ``QuantizedKVCache.from_pool``) only extends its own prompt; ``reset()``
(a fresh session, unbound) is how a cache is reused for a new prompt."""

from __future__ import annotations

import pytest
import torch

from kvquant import PagedKVPool, QuantizedKVCache
from kvquant.cache import BoundIdsError
from kvquant.errors import InputError

from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", heads=4, kv_heads=2, head_dim=64)


def _ids(seed: int, n: int = 40, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_bound_cache_refuses_other_ids_and_writes_nothing(model):
    pool = PagedKVPool(model, {"default": "int8-token", "block_size": 16})
    a, b = _ids(1), _ids(2)
    cache = QuantizedKVCache.from_pool(pool, a)
    with torch.no_grad():
        model(a[:, :30], cache=cache, use_cache=True)
        model(a[:, 30:], cache=cache, use_cache=True)  # extends its own prompt
        model(torch.tensor([[7]]), cache=cache, use_cache=True)  # past the prompt: new tokens are free
    indexed, length = pool.stats()["indexed_blocks"], cache.get_seq_length()
    cache.crop(-(length - 20))
    refusal = r"^input_ids: row 0 has token \d+ at position \d+ .*cache\.reset\(\)"
    with pytest.raises(BoundIdsError, match=refusal) as e, torch.no_grad():
        model(b[:, 20:], cache=cache, use_cache=True)  # another prompt's tokens at positions 20..39
    assert isinstance(e.value, InputError) and "\n" not in str(e.value)
    assert cache.get_seq_length() == 20 and pool.stats()["indexed_blocks"] == indexed
    with pytest.raises(BoundIdsError, match="2 rows"), torch.no_grad():
        model(torch.cat([a, a])[:, 20:], cache=cache, use_cache=True)


def test_reset_unbinds_and_starts_a_new_session(model):
    """reset(): every token forgotten, the binding dropped, a new session id; a new prompt then runs and its
    blocks are not indexed under the old prompt's hashes (which would serve them to the next request for it)."""
    pool = PagedKVPool(model, {"default": "int8-token", "block_size": 16})
    a, b = _ids(3), _ids(4)
    cache = QuantizedKVCache.from_pool(pool, a)
    old = cache.session_id
    cache.reset()
    assert cache.token_ids is None and cache.session_id != old and cache.get_seq_length() == 0
    with torch.no_grad():
        got = model(b, cache=cache, use_cache=True).logits
        ref = model(b, cache=QuantizedKVCache(model, pool.config), use_cache=True).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert pool.stats()["indexed_blocks"] == 0
    # nothing indexed for a: b's blocks were not filed under a's hashes
    assert QuantizedKVCache.from_pool(pool, a).get_seq_length() == 0


def test_bound_ids_follow_a_reorder(model):
    """Beam reorders move the bound ids with their rows: a row keeps extending its own prompt."""
    pool = PagedKVPool(model, {"default": "int8-token", "block_size": 16})
    ids = torch.cat([_ids(5), _ids(6)])
    cache = QuantizedKVCache.from_pool(pool, ids)
    with torch.no_grad():
        model(ids[:, :24], cache=cache, use_cache=True)
        cache.reorder_cache(torch.tensor([1, 0]))
        model(ids.flip(0)[:, 24:], cache=cache, use_cache=True)  # each row's own next tokens
        cache.crop(-16)
        with pytest.raises(BoundIdsError):
            model(ids[:, 24:], cache=cache, use_cache=True)  # the rows' tokens swapped back: not their own
    assert cache.token_ids == ids.flip(0).tolist()
