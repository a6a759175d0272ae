"""Triton attention kernels vs the torch references (``attend_torch`` and the fp32 ``attend_naive``).

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set below before the
kernels are imported); on a CUDA machine (``benchmarks/gpu_check.sh``) the same tests run compiled.
Contract: max abs error <= 1e-5 against the fp32 reference for fp32 queries (measured: at most
~6e-6 under the interpreter, every precision, option and layout; was 2e-3).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from kvquant.config import KVPrecision, KVQuantConfig  # noqa: E402
from kvquant.kernels import dispatch  # noqa: E402
from kvquant.kernels.attention_torch import attend_naive, attend_torch  # noqa: E402
from kvquant.kernels.dispatch import Unsupported  # noqa: E402
from kvquant.kernels.triton_attention import attend_triton, interpreted, key_ranges  # noqa: E402
from kvquant.store import LayerStore  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5
ALL = ["fp16", "bf16", "fp32", "int8", "int8-token", "int4", "int3", "int2", "fp8-e4m3", "fp8-e5m2"]


def test_interpreter_on_cpu():
    # on CPU the kernels must have been built by the interpreter, else every test below would only
    # exercise the Unsupported fallback
    assert DEV.type == "cuda" or interpreted(), "TRITON_INTERPRET=1 was not set before the kernels were imported"


def make_layer(row, B=2, D=64, past=77, Tq=1, block=16, steps=(), seed=0, dtype=torch.float32, **options):
    """A LayerStore holding ``past`` tokens (written as a prefill, then ``steps`` more appends), the
    fresh chunk of ``Tq`` tokens appended after it, and ``(fresh_k, fresh_v)``. ``options``: extra
    config fields (``sink_tokens``, ``residual_tokens``, ...)."""
    g = torch.Generator().manual_seed(seed)
    cfg = KVQuantConfig(block_size=block, **options)
    row = [r if isinstance(r, KVPrecision) else KVPrecision(r, r) for r in row]
    layer = LayerStore(row, cfg, D, B, DEV)
    H = len(row)
    # channel-dependent magnitudes, so per-head / per-group scales matter
    mag = torch.rand(1, H, 1, D, generator=g) * 2 + 0.25
    k = (torch.randn(B, H, past + Tq, D, generator=g) * mag).to(DEV, dtype)
    v = (torch.randn(B, H, past + Tq, D, generator=g) * mag).to(DEV, dtype)
    cuts = [0, *[c for c in steps if 0 < c < past], past]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if b > a:
            layer.append(k[:, :, a:b], v[:, :, a:b])
    fk, fv = k[:, :, past:], v[:, :, past:]
    layer.append(fk, fv)
    return layer, fk, fv


def query(B, Hq, Tq, D, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Tq, D, generator=g) * 1.5).to(DEV, dtype)


def check(q, fk, fv, layer, past, mask=None, tol=TOL, softcap=None, **kw):
    scaling = q.shape[-1] ** -0.5
    out = attend_triton(q, fk, fv, layer, past, mask, scaling, softcap=softcap, **kw)
    ref = attend_naive(q.float(), fk, fv, layer, past, mask, scaling, softcap)
    walk = attend_torch(q, fk, fv, layer, past, mask, scaling, softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= tol, f"max abs error vs fp32 reference {err:.2e} > {tol:.0e}"
    err_walk = (out.float() - walk.float()).abs().max().item()
    assert err_walk <= tol, f"max abs error vs attend_torch {err_walk:.2e}"
    return err


# ------------------------------------------------------------------------------------- precisions
PAIRS = [(p, p) for p in ALL] + [("int8-token", "int4"), ("fp8-e4m3", "int8"), ("int4", "fp16"), ("fp32", "fp8-e5m2")]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}/{p[1]}")
def test_decode_every_precision(pair):
    layer, fk, fv = make_layer([KVPrecision(*pair)] * 2, past=77, steps=(40, 41))
    q = query(2, 8, 1, 64)
    check(q, fk, fv, layer, 77, splits=3)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}/{p[1]}")
def test_chunk_every_precision(pair):
    layer, fk, fv = make_layer([KVPrecision(*pair)] * 2, past=70, Tq=9)
    q = query(2, 4, 9, 64)
    check(q, fk, fv, layer, 70, block_m=16)


MIXED = ["int4", "int8", "fp16", "int4", "fp8-e4m3", "int8-token", KVPrecision("int8-token", "int4"), "int2"]


@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_gqa_mixed_heads_decode(rep):
    H = 4
    row = MIXED[rep % 4 : rep % 4 + H]  # interleaved heads of 3-4 groups, none holding all heads
    layer, fk, fv = make_layer(row, B=3, past=131)
    groups = layer.snapshot().groups
    assert len(groups) >= 3 and not any(g.all_heads for g in groups)
    check(query(3, H * rep, 1, 64), fk, fv, layer, 131, splits=2)


@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_gqa_mixed_heads_chunk(rep):
    row = MIXED[4:8]
    layer, fk, fv = make_layer(row, B=2, past=45, Tq=6)
    check(query(2, 4 * rep, 6, 64), fk, fv, layer, 45, block_m=32)


@pytest.mark.parametrize("splits", [1, 2, 7, 50])
def test_decode_splits(splits):
    """Any number of partitions (more than tiles included) gives the same result."""
    layer, fk, fv = make_layer(["int4", "int8"], B=1, past=200)
    check(query(1, 4, 1, 64), fk, fv, layer, 200, splits=splits)


@pytest.mark.parametrize("D", [16, 32, 128])
def test_head_dims(D):
    row = ["int2", "int4", "int8-token", "fp8-e5m2", "int3"]
    layer, fk, fv = make_layer(row, B=1, D=D, past=50)
    check(query(1, 10, 1, D), fk, fv, layer, 50, splits=2)
    layer, fk, fv = make_layer(row, B=1, D=D, past=30, Tq=4)
    check(query(1, 10, 4, D), fk, fv, layer, 30, block_m=16)


@pytest.mark.parametrize("D", [8, 48, 96])
def test_unsupported_head_dim(D):
    layer, fk, fv = make_layer(["fp16"], B=1, D=D, past=5)
    q = query(1, 2, 1, D)
    with pytest.raises(Unsupported, match="head_dim"):
        attend_triton(q, fk, fv, layer, 5, None, D**-0.5)
    # the dispatcher falls back to the torch path
    out = dispatch.attend(q, fk, fv, layer, 5, None, D**-0.5)
    assert torch.allclose(out, attend_torch(q, fk, fv, layer, 5, None, D**-0.5))


def test_empty_history():
    layer, fk, fv = make_layer(["int8", "int4"], past=0, Tq=1)
    check(query(2, 4, 1, 64), fk, fv, layer, 0)
    layer, fk, fv = make_layer(["int8", "int4"], past=0, Tq=11)
    check(query(2, 4, 11, 64), fk, fv, layer, 0, block_m=16)


def test_fp8_native_path(monkeypatch):
    """The native fp8 load (tl.float8e4nv / tl.float8e5), as run on Hopper, also checked here."""
    from kvquant.kernels import triton_attention

    if DEV.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native fp8 conversions need compute capability >= 8.9")
    monkeypatch.setattr(triton_attention, "native_fp8", lambda device: True)
    layer, fk, fv = make_layer([KVPrecision("fp8-e4m3", "fp8-e5m2"), KVPrecision("fp8-e5m2", "fp8-e4m3")], past=60)
    check(query(2, 4, 1, 64), fk, fv, layer, 60, splits=2)
    layer, fk, fv = make_layer(["fp8-e4m3", "fp8-e5m2"], past=40, Tq=5)
    check(query(2, 4, 5, 64), fk, fv, layer, 40, block_m=16)
    # fp16 queries: the decode tile is converted fp8 -> fp16 straight from the bytes
    layer, fk, fv = make_layer([KVPrecision("fp8-e4m3", "fp8-e5m2"), "fp8-e4m3"], past=60, dtype=torch.float16)
    q = query(2, 4, 1, 64, dtype=torch.float16)
    out = attend_triton(q, fk, fv, layer, 60, None, 0.125, splits=2)
    ref = attend_naive(q.float(), fk, fv, layer, 60, None, 0.125)
    walk = attend_torch(q, fk, fv, layer, 60, None, 0.125)
    assert (out.float() - ref).abs().max() <= (walk.float() - ref).abs().max() + 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries(dtype):
    """fp16/bf16 models: MMAs in the query dtype with fp32 accumulation (tensor cores on a GPU).

    A half-precision *output* alone is off the fp32 reference by up to half an ulp (fp16: 1e-3 at
    |o| ~ 4; bf16: 8e-3), which is the error of the torch path too. The kernel must add nothing
    visible to that: its error vs the fp32 reference <= the torch path's + 1e-4 (fp16) / 1e-3 (bf16).
    """
    slack = 1e-4 if dtype == torch.float16 else 1e-3
    for row in (["int8", "int4"], ["fp16", "int8-token"], ["fp8-e4m3", "int2"]):
        for past, Tq in ((90, 1), (33, 5)):
            layer, fk, fv = make_layer(row, past=past, Tq=Tq, dtype=dtype)
            q = query(2, 8, Tq, 64, dtype=dtype)
            out = attend_triton(q, fk, fv, layer, past, None, 0.125, splits=2, block_m=16)
            assert out.dtype == dtype
            ref = attend_naive(q.float(), fk, fv, layer, past, None, 0.125)
            walk = attend_torch(q, fk, fv, layer, past, None, 0.125)
            err = (out.float() - ref).abs().max().item()
            err_walk = (walk.float() - ref).abs().max().item()
            assert err <= err_walk + slack, f"{row} Tq={Tq}: {err:.2e} vs torch path {err_walk:.2e}"


# ------------------------------------------------------------------------------------------- masks
def padded_mask(pads, past, Tq, heads=1):
    """transformers' left-padding SDPA mask: row b sees keys pads[b] <= j <= past + t."""
    L = past + Tq
    j = torch.arange(L).view(1, 1, L)
    qpos = torch.arange(Tq).view(1, Tq, 1) + past
    pad = torch.tensor(pads).view(-1, 1, 1)
    m = (j >= pad) & (j <= qpos)
    return m.unsqueeze(1).expand(len(pads), heads, Tq, L).to(DEV)


def test_left_padding_decode():
    pads = [0, 30, 76, 77]  # a long row, a padded one, one with only the fresh token, one with nothing visible
    layer, fk, fv = make_layer(["int8", "int4", "fp8-e4m3", "int8-token"], B=4, past=77)
    mask = padded_mask(pads, 77, 1)
    mask[3] = False  # a fully masked row: output 0, as the torch path
    err = check(query(4, 8, 1, 64), fk, fv, layer, 77, mask=mask, splits=3)
    assert err <= TOL
    out = attend_triton(query(4, 8, 1, 64), fk, fv, layer, 77, mask, 0.125)
    assert out[3].abs().max() == 0


def test_left_padding_chunk():
    pads = [0, 19, 50]  # the last row's padding reaches into the chunk
    layer, fk, fv = make_layer(["int4", KVPrecision("int8-token", "int4")], B=3, past=45, Tq=8)
    mask = padded_mask(pads, 45, 8)
    check(query(3, 4, 8, 64), fk, fv, layer, 45, mask=mask, block_m=16)


def test_per_head_mask_and_extra_columns():
    layer, fk, fv = make_layer(["int8", "int4"], B=2, past=40, Tq=3)
    mask = padded_mask([0, 7], 40, 3, heads=4)
    q = query(2, 4, 3, 64)
    check(q, fk, fv, layer, 40, mask=mask, block_m=16)
    wide = torch.cat([mask, torch.ones_like(mask[..., :5])], dim=-1)  # static-cache style extra columns
    out = attend_triton(q, fk, fv, layer, 40, wide, 0.125, block_m=16)
    assert (out - attend_naive(q, fk, fv, layer, 40, mask, 0.125)).abs().max() <= TOL


def test_non_contiguous_mask_falls_back():
    """Chunks: a mask the kernels cannot serve falls back to torch. Decode: checked on the device
    without a host synchronisation, so it cannot fall back; it raises (at once on CPU)."""
    layer, fk, fv = make_layer(["int8"], B=1, past=30, Tq=3)
    q = query(1, 2, 3, 64)
    mask = padded_mask([0], 30, 3)
    mask[..., 10:15] = False  # a hole: not one key range
    with pytest.raises(Unsupported, match="contiguous"):
        attend_triton(q, fk, fv, layer, 30, mask, 0.125)
    heads = padded_mask([0], 30, 3, heads=2).clone()
    heads[:, 1, :, :3] = False
    with pytest.raises(Unsupported, match="heads"):
        attend_triton(q, fk, fv, layer, 30, heads, 0.125)
    out = dispatch.attend(q, fk, fv, layer, 30, mask, 0.125)
    assert torch.allclose(out, attend_naive(q, fk, fv, layer, 30, mask, 0.125), atol=1e-5)
    layer, fk, fv = make_layer(["int8"], B=1, past=30)
    for bad in (padded_mask([0], 30, 1).clone(), padded_mask([0], 30, 1, heads=2).clone()):
        bad[:, -1, :, 10:15] = False
        with pytest.raises(RuntimeError, match="contiguous key range"):
            attend_triton(query(1, 2, 1, 64), fk, fv, layer, 30, bad, 0.125)


def test_key_ranges():
    mask = padded_mask([0, 3], 5, 2)
    lo, hi = key_ranges(mask, 2, 1, 2, 5)
    assert lo.tolist() == [[0, 0], [3, 3]] and hi.tolist() == [[6, 7], [6, 7]]
    assert key_ranges(None, 2, 1, 2, 5) is None


@pytest.fixture
def triton_calls(monkeypatch):
    """Force ``KVQUANT_ATTENTION=triton`` and record each ``attend_triton`` call (1 per call)."""
    from kvquant.kernels import triton_attention

    calls = []
    real = triton_attention.attend_triton

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(1)
        return out

    monkeypatch.setattr(triton_attention, "attend_triton", spy)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    return calls


def test_dispatch_forced_triton(triton_calls):
    """``KVQUANT_ATTENTION=triton`` runs the Triton kernels (not the fallback)."""
    calls = triton_calls
    layer, fk, fv = make_layer(["int4"], B=1, past=20)
    q = query(1, 2, 1, 64)
    out = dispatch.attend(q, fk, fv, layer, 20, None, 0.125)
    assert calls == [1]
    assert (out - attend_naive(q, fk, fv, layer, 20, None, 0.125)).abs().max() <= TOL


def dense_layer(option, B=2, H=2, past=41, Tq=1, steps=(), seed=0):
    """A LayerStore with sink tokens and/or a residual window (see :func:`make_layer`)."""
    row = [KVPrecision("int8", "int4"), KVPrecision("int4", "int8-token")][:H]
    return make_layer(row, B=B, past=past, Tq=Tq, steps=steps, seed=seed, **option)


DENSE = {
    "sinks": {"sink_tokens": 4},
    "residual": {"residual_tokens": 16},
    "sinks+residual": {"sink_tokens": 5, "residual_tokens": 20},
}


@pytest.mark.parametrize("option", list(DENSE), ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-pad"])
def test_dense_segments_triton(option, padded):
    """Sink tokens and a residual window: the kernels over the quantized pool, the dense keys in
    torch, merged by log-sum-exp; same result as the fp32 reference."""
    errs = []
    for past, Tq, steps in ((77, 1, (40, 41, 60)), (45, 8, (20,))):
        layer, fk, fv = dense_layer(DENSE[option], B=3, past=past, Tq=Tq, steps=steps)
        if "residual_tokens" in DENSE[option]:
            assert 0 < min(layer.q_end, past) < past  # both a pool and a residual part
        # pads: none; one inside the sinks (or pool); one in the residual / reaching the chunk
        mask = padded_mask([0, 2, past - 3 if Tq == 1 else past + 2], past, Tq) if padded else None
        q = query(3, 4, Tq, 64)
        errs.append(check(q, fk, fv, layer, past, mask=mask, splits=3, block_m=16))
    assert max(errs) <= TOL


@pytest.mark.parametrize("Tq", [1, 6])
def test_dense_segments_all_in_residual(Tq):
    """An empty pool (everything still in the residual window), with sinks; causal and padded."""
    layer, fk, fv = dense_layer({"sink_tokens": 3, "residual_tokens": 64}, B=2, past=30, Tq=Tq, steps=(12,))
    assert layer.q_end == 0
    q = query(2, 4, Tq, 64)
    check(q, fk, fv, layer, 30, splits=2, block_m=16)
    mask = padded_mask([0, 7], 30, Tq)
    mask[1, :, :, :] = False  # a fully masked row: output 0
    check(q, fk, fv, layer, 30, mask=mask, splits=2, block_m=16)
    out = attend_triton(q, fk, fv, layer, 30, mask, 0.125)
    assert out[1].abs().max() == 0


def test_dense_segments_through_dispatch(triton_calls):
    """``KVQUANT_ATTENTION=triton``: a store with sinks and a residual is served by the Triton path."""
    calls = triton_calls
    layer, fk, fv = dense_layer(DENSE["sinks+residual"], B=1, past=50)
    q = query(1, 4, 1, 64)
    out = dispatch.attend(q, fk, fv, layer, 50, None, 0.125)
    assert calls == [1]
    assert (out - attend_naive(q, fk, fv, layer, 50, None, 0.125)).abs().max() <= TOL


CHANNEL_KEYS = ["int4-channel", "int3-channel", "int2-channel"]
CHANNEL_VALUES = [("int4-channel", "int2-channel"), ("int3-channel", "int4-channel"), ("int2-channel", "int3-channel")]
CHANNEL_PAIRS = [(k, v) for k in CHANNEL_KEYS for v in ("int4", "int8-token", "fp16")] + CHANNEL_VALUES + [
    ("int8-channel", "int8-token")  # the int8-kchannel preset (the wrap() default)
]
CHANNEL_OPTIONS = {"blocks": {}, "sinks+residual": {"sink_tokens": 5, "residual_tokens": 20}}


def channel_layer(pair, option, B=3, past=77, Tq=1, steps=(), seed=0):
    """A LayerStore whose first KV head (of two) is ``pair`` with per-channel keys (``int*-channel``,
    blocks of 16 tokens, so the store is in residual mode: the pool holds whole blocks), the second
    head int8/int4 (a second head group); returns (layer, fresh_k, fresh_v)."""
    row = [KVPrecision(*pair), KVPrecision("int8", "int4")]
    return make_layer(row, B=B, past=past, Tq=Tq, steps=steps, seed=seed, **option)


@pytest.mark.parametrize("pair", CHANNEL_PAIRS, ids=lambda p: f"{p[0]}/{p[1]}")
def test_channel_keys_triton(pair, triton_calls):
    """Per-channel key blocks (KIVI keys; and per-channel values) are served by the Triton kernels
    through the dispatcher: decode and chunk, GQA 3, whole blocks in the pool + a residual (and sink
    tokens), causal and left-padded; same result as the fp32 reference."""
    calls = triton_calls
    errs = []
    for option in CHANNEL_OPTIONS.values():
        for past, Tq, steps in ((77, 1, (40, 41, 60)), (45, 8, (20,))):
            layer, fk, fv = channel_layer(pair, option, past=past, Tq=Tq, steps=steps)
            assert layer.q_end % 16 == 0 and layer.q_end >= 16  # whole blocks (decode: + a residual)
            assert Tq > 1 or layer.q_end < past
            q = query(3, 6, Tq, 64)
            for mask in (None, padded_mask([0, 2, past - 3 if Tq == 1 else past + 2], past, Tq)):
                n = len(calls)
                out = dispatch.attend(q, fk, fv, layer, past, mask, 0.125)
                assert len(calls) == n + 1, "the Triton path did not serve the call"
                ref = attend_naive(q, fk, fv, layer, past, mask, 0.125)
                assert torch.isfinite(out).all()
                errs.append((out - ref).abs().max().item())
                errs.append(check(q, fk, fv, layer, past, mask=mask, splits=3, block_m=16))
    assert max(errs) <= TOL, f"max abs error vs fp32 reference {max(errs):.2e}"


@pytest.mark.parametrize("transposed", [True, False], ids=["rows_t", "rows_mma_sync"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_channel_keys_folded_decode(dtype, transposed, monkeypatch):
    """Per-channel int4 keys in blocks of 64 tokens: the decode kernel folds each block's scale into the
    query and its zero into one term per head (``qk_channel4``); same result as the fp32 reference
    (fp16 queries: within the torch path's own error + 1e-4). ``transposed=False`` is the launch triton < 3.7
    gets (:data:`~kvquant.kernels.triton_decode_table.CHANNEL_KEYS_TRANSPOSED`)."""
    from kvquant.kernels import triton_decode_table

    monkeypatch.setattr(triton_decode_table, "CHANNEL_KEYS_TRANSPOSED", transposed)
    row = [KVPrecision("int4-channel", "int4"), KVPrecision("int4-channel", "int8-token")]
    layer, fk, fv = make_layer(row, B=2, past=300, block=64, steps=(130, 131, 200), dtype=dtype)
    assert layer.q_end >= 192 and layer.snapshot().groups[0].key.quantizer.token_group == 64
    from kvquant.kernels.triton_dequant import operand

    assert operand(layer.snapshot().groups[0].key, 64, False).folds_channel4()
    q = query(2, 6, 1, 64, dtype=dtype)
    for mask in (None, padded_mask([0, 70], 300, 1)):
        if dtype == torch.float32:
            check(q, fk, fv, layer, 300, mask=mask, splits=3)
            continue
        out = attend_triton(q, fk, fv, layer, 300, mask, 0.125, splits=3)
        ref = attend_naive(q.float(), fk, fv, layer, 300, mask, 0.125)
        walk = attend_torch(q, fk, fv, layer, 300, mask, 0.125)
        assert (out.float() - ref).abs().max() <= (walk.float() - ref).abs().max() + 1e-4


@pytest.mark.parametrize("transposed", [True, False])
def test_channel_keys_launch_follows_the_triton_gate(transposed, monkeypatch):
    """Per-channel int4 keys with fp16 queries launch the transposed rows kernel only where triton compiles it."""
    from kvquant.kernels import triton_decode_table, triton_rows
    from kvquant.kernels.triton_compile_check import meta_launches

    monkeypatch.setattr(triton_decode_table, "CHANNEL_KEYS_TRANSPOSED", transposed)
    (launch,) = meta_launches("decode", [("int4-channel", "int4", 2)], 1, 128, 4, True)
    want = triton_rows._decode_partial_rows_t if transposed else triton_rows._decode_partial_rows
    assert launch.kernel is want


def test_channel_operand():
    """The part description of a per-channel store: kind CHANNEL, one scale/zero row per pool block
    (``[num_blocks, H, 1, D]``; the block address picks it, so the operand's group is 1)."""
    from kvquant.kernels.triton_dequant import KIND_CHANNEL, operand

    layer, _, _ = channel_layer(("int3-channel", "int2-channel"), {}, B=1, past=40)
    g = layer.snapshot().groups[0]
    for part, bits in ((g.key, 3), (g.value, 2)):
        op = operand(part, 64, False)
        assert (op.kind, op.bits, op.group) == (KIND_CHANNEL, bits, 1)
        assert op.scale.shape[2] == 1 and op.data.shape[2] == 16 and op.scale.shape[-1] == 64


def test_rotated_store_through_dispatch(monkeypatch, triton_calls):
    """``rotate: kv``: dispatch rotates queries / fresh K/V into storage space and the output back;
    the Triton path then gives the torch path's result."""
    layer = LayerStore([KVPrecision("int4", "int8")] * 2, KVQuantConfig(block_size=16, rotate="kv"), 64, 2, DEV)
    k, v = torch.randn(2, 2, 60, 64, device=DEV), torch.randn(2, 2, 60, 64, device=DEV)
    layer.append(k[:, :, :59], v[:, :, :59])
    layer.append(k[:, :, 59:], v[:, :, 59:])
    q = query(2, 4, 1, 64)
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    ref = dispatch.attend(q, k[:, :, 59:], v[:, :, 59:], layer, 59, None, 0.125)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    out = dispatch.attend(q, k[:, :, 59:], v[:, :, 59:], layer, 59, None, 0.125)
    assert triton_calls == [1]
    assert (out - ref).abs().max() <= TOL


# ------------------------------------------------------------ fp16 queries: the transposed decode kernels
@pytest.mark.parametrize(
    ("row", "D", "rep", "block"),
    [
        (["int8", "int8"], 64, 4, 16),
        (["int8-token", "int8"], 128, 1, 64),
        (["int4", "int4"], 64, 4, 16),
        (["int4", "int4"], 128, 8, 64),
        (["int4", "int8"], 128, 2, 32),
        (["int2", "int2"], 64, 4, 16),
        (["int2", "int3"], 128, 4, 128),
        (["int3", "int3"], 64, 8, 32),
        ([KVPrecision("int4", "int2"), KVPrecision("int3", "int4")], 128, 3, 64),
        (["int2", "int2"], 256, 4, 64),  # 8 groups: head-major columns, the keys' zero products in fp32 (COLS 0)
    ],
    ids=lambda x: str(x),
)
def test_transposed_decode_fp16_queries_exact(row, D, rep, block):
    """int8 K/V (:func:`_decode_partial_t`) and grouped int4 K/V (:func:`_decode_partial_rows_t`) with fp16
    queries: codes by 32-bit words (int8: and + xor; int4: and + or magic numbers, channels in perm4 order),
    fp16 MMAs. The kernels' own result is written in fp32 (the output buffer's dtype), so the check is not
    hidden by the fp16 rounding of the output: within 2e-5 of the fp32 reference, causal and left-padded
    (masked edge tiles), several partitions."""
    from kvquant.kernels import triton_decode
    from kvquant.kernels.triton_attention import block_table
    from kvquant.kernels.triton_dequant import DOT_FP16, operand

    past = 150
    layer, fk, fv = make_layer(row, D=D, past=past, block=block, steps=(70,), dtype=torch.float16)
    Hq = len(row) * rep
    q = query(2, Hq, 1, D, dtype=torch.float16)
    scaling = D**-0.5
    snap = layer.snapshot()
    groups = [(g.head_index, operand(g.key, D, False), operand(g.value, D, False)) for g in snap.groups]
    table = block_table(snap, past, 2, DEV)
    rows_t = "_decode_partial_rows_t"
    want = {"int8": "_decode_partial_t", "int8-token": "_decode_partial_t", "int4": rows_t, "int3": rows_t,
            "int2": rows_t, KVPrecision("int4", "int2"): rows_t, KVPrecision("int3", "int4"): rows_t}  # fmt: skip
    for mask in (None, padded_mask([0, 41], past, 1)):
        ranges = key_ranges(mask, 2, Hq, 1, past)
        out = torch.zeros(2, Hq, 1, D)  # fp32: the kernels' result unrounded
        launches = triton_decode.decode_launches(q, fk, fv, groups, layer.num_heads, past, ranges, scaling, out,
                                                 DOT_FP16, splits=3, table=table, block_size=block)  # fmt: skip
        names = [launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else launch.kernel.__name__
                 for launch in launches[:-1]]  # fmt: skip
        assert names == [want[r] for r in dict.fromkeys(row)], names  # one launch per head group
        for launch in launches:
            launch.run()
        ref = attend_naive(q.float(), fk, fv, layer, past, mask, scaling)
        err = (out - ref).abs().max().item()
        assert err <= 2e-5, f"{row} D={D} rep={rep}: max error {err:.2e} vs the fp32 reference"


@pytest.mark.parametrize(("D", "rep", "block", "group"), [(128, 3, 64, 32), (128, 8, 128, 32), (64, 4, 64, 32),
                                                      (256, 2, 64, 16)])  # fmt: skip
def test_transposed_decode_channel_keys_fp16_exact(D, rep, block, group):
    """Per-channel int4 keys + grouped int4 values with fp16 queries (:func:`_decode_partial_rows_t`,
    ``K_FOLD`` 2: the block's key scale folded into an fp32 query split into two fp16 MMA operands, the zero
    term an MMA of ones): the kernels' fp32 result over the quantized pool within 2e-5 of the fp32 reference."""
    from kvquant.kernels import triton_decode, triton_rows
    from kvquant.kernels.triton_attention import block_table
    from kvquant.kernels.triton_dequant import DOT_FP16, operand

    row = [KVPrecision("int4-channel", "int4")] * 2
    layer, fk, fv = make_layer(row, D=D, past=300, block=block, steps=(130, 131, 200), dtype=torch.float16,
                               group_size=group)  # fmt: skip
    hist = layer.q_end  # the pool: whole blocks
    Hq = 2 * rep
    q = query(2, Hq, 1, D, dtype=torch.float16)
    snap = layer.snapshot()
    groups = [(g.head_index, operand(g.key, D, False), operand(g.value, D, False)) for g in snap.groups]
    table = block_table(snap, hist, 2, DEV)
    for mask in (None, padded_mask([0, 70], hist, 1)):
        ranges = key_ranges(mask, 2, Hq, 1, hist)
        out = torch.zeros(2, Hq, 1, D)
        launches = triton_decode.decode_launches(q, fk, fv, groups, layer.num_heads, hist, ranges, D**-0.5, out,
                                                 DOT_FP16, splits=3, table=table, block_size=block)  # fmt: skip
        assert launches[0].kernel is triton_rows._decode_partial_rows_t
        # two tiles per loop step (the block's query operands built once) where a pool block holds them
        assert launches[0].meta["SUB"] == (2 if block % (2 * launches[0].meta["BLOCK_N"]) == 0 else 1)
        for launch in launches:
            launch.run()
        err = (out - attend_naive(q.float(), fk, fv, layer, hist, mask, D**-0.5)).abs().max().item()
        assert err <= 2e-5, f"D={D} rep={rep}: max error {err:.2e} vs the fp32 reference"


@pytest.mark.parametrize("case", ["offsets64", "large_query", "zero_halves"])
def test_transposed_rows_kernel_options(case, monkeypatch):
    """Grouped int4 K/V on :func:`_decode_partial_rows_t` (fp16 queries) beyond the default specialisation:
    ``offsets64`` -- the 64-bit offset path (``OFF32`` False: what a pool with offsets past 2**31 elements gets);
    ``large_query`` -- a query with max |q| ~ 6000, where the key operand (16 x the low channels' query rows) would
    overflow fp16 without the power-of-two prescale ``qf`` < 1 (and the zero-term MMA's query sums, x 2**17 in the
    scores' units, stay in fp16's range); ``zero_halves`` -- zero rows not readable as 32-bit words (``KZW``
    False): the keys' zero term by fp32 products instead of the zero-term MMA. All within 2e-5 of the fp32
    reference."""
    from kvquant.kernels import triton_decode, triton_rows
    from kvquant.kernels.triton_attention import block_table
    from kvquant.kernels.triton_dequant import DOT_FP16, Operand, operand

    D, rep, block, past = 128, 4, 64, 150
    layer, fk, fv = make_layer(["int4", "int4"], D=D, past=past, block=block, steps=(70,), dtype=torch.float16)
    Hq = 2 * rep
    q = query(2, Hq, 1, D)
    scaling = D**-0.5
    if case == "offsets64":
        monkeypatch.setattr(Operand, "offsets32", lambda self: False)
    elif case == "zero_halves":
        monkeypatch.setattr(triton_rows, "_word_rows", lambda t: False)
    else:
        q = q * (6000.0 / q.abs().max())  # |16 q| past fp16's 65504
        scaling = scaling / 4000.0  # scores of the usual size
    q = q.to(torch.float16)
    snap = layer.snapshot()
    groups = [(g.head_index, operand(g.key, D, False), operand(g.value, D, False)) for g in snap.groups]
    table = block_table(snap, past, 2, DEV)
    for mask in (None, padded_mask([0, 41], past, 1)):
        ranges = key_ranges(mask, 2, Hq, 1, past)
        out = torch.zeros(2, Hq, 1, D)
        launches = triton_decode.decode_launches(q, fk, fv, groups, layer.num_heads, past, ranges, scaling, out,
                                                 DOT_FP16, splits=3, table=table, block_size=block)  # fmt: skip
        assert launches[0].kernel is triton_rows._decode_partial_rows_t
        assert launches[0].meta["OFF32"] is (case != "offsets64")
        assert launches[0].meta["KZW"] is (case != "zero_halves")
        for launch in launches:
            launch.run()
        ref = attend_naive(q.float(), fk, fv, layer, past, mask, scaling)
        err = (out - ref).abs().max().item()
        assert err <= 2e-5, f"{case}: max error {err:.2e} vs the fp32 reference"
