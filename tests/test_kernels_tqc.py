"""Per-channel-width keys ``tqc-<widths>`` read in-kernel by the Triton decode and chunk kernels (interpreter on
CPU): the host-side row tables against the quantizer's own packing, the kernels against the torch block walk and
the fp32 reference (every width 0..8, byte-crossing codes, tqc keys with tq3 / tq4 values, tqc values, beside
int8 / int4 heads, sinks + residual incl. residual_step 1, shuffled block tables, half-precision queries), and
dispatch running tqc layers on Triton instead of falling back to torch."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from kvquant.config import KVPrecision, KVQuantConfig  # noqa: E402
from kvquant.kernels import dispatch, triton_launch  # noqa: E402
from kvquant.kernels.attention_torch import attend_naive, attend_torch  # noqa: E402
from kvquant.kernels.triton_attention import attend_triton  # noqa: E402
from kvquant.kernels.triton_codebook import KIND_TQC, TQC_ZERO, tqc_channel_info, tqc_level_table, tqc_rows  # noqa: E402
from kvquant.kernels.triton_dequant import operand  # noqa: E402
from kvquant.quantizers import ChannelCodebook, channel_precision  # noqa: E402
from kvquant.store import LayerStore  # noqa: E402
from tests.test_codebook import OPTIONS, codebook_layer, model_space_reference  # noqa: E402
from tests.test_kernels_paged import shuffle_blocks  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5  # fp32 queries, against the fp32 reference on the same stored rows

# every width 0..8; 5..8-bit codes that cross a byte boundary; 3.5 bits on average (224 bits)
W4 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 2, 1] + [4] * 26 + [3] * 26
# 3 bits on average: 3-bit runs (a code crosses a byte every third channel), 5 / 1 and 2 / 4 pairs
W3 = [3] * 32 + [5, 1] * 8 + [2, 4] * 8
# a real SmolLM2-135M key head (research/configs/tqc4-v72-r15s1.yaml): 4 bits on average, widths 1..8
WREAL = [int(c) for c in "1111223334344444444455465555678611212233333445445555545555556667"]
T4, T3, TR = channel_precision(W4), channel_precision(W3), channel_precision(WREAL)
assert sum(W4) % 8 == 0 and sum(W3) == 192 and sum(WREAL) == 256


def kernel_kinds(monkeypatch) -> list[tuple[int, int]]:
    """Record the (K kind, V kind) of every kernel launch that has them."""
    seen: list[tuple[int, int]] = []
    real = triton_launch.Launch.run

    def run(self):
        if "K_KIND" in self.meta:
            seen.append((self.meta["K_KIND"], self.meta["V_KIND"]))
        return real(self)

    monkeypatch.setattr(triton_launch.Launch, "run", run)
    return seen


def no_fallback(monkeypatch) -> None:
    def fail(*a, **kw):
        raise AssertionError("the Triton path fell back to torch")

    monkeypatch.setattr(dispatch, "attend_torch", fail)


# ------------------------------------------------------------------------------------------- host side
@pytest.mark.parametrize("widths", [W4, W3, WREAL], ids=["w4", "w3", "real"])
def test_rows_match_the_quantizers_packing(widths):
    """The kernels' per-channel words (byte, shift, width, level base) and level table decode exactly the quantizer's
    codes and levels: emulated in torch, the kernel's formula gives :meth:`ChannelCodebook.decode_space` / norm."""
    D = len(widths)
    qz = ChannelCodebook(D, widths)
    info = tqc_channel_info(qz.widths).long()
    byte, shift, width, base = info & 255, (info >> 8) & 7, (info >> 12) & 15, info >> 16
    assert torch.equal(byte, qz._byte) and torch.equal(shift, qz._shift) and torch.equal(width, qz.widths)
    levels = tqc_level_table()
    for j, w in enumerate(widths):
        got = levels[base[j] : base[j] + 2**w] if w else levels[TQC_ZERO : TQC_ZERO + 1]
        assert torch.equal(got, qz.table[j, : 2**w] if w else torch.zeros(1)), j
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 9, D, generator=g) * (torch.rand(D, generator=g) + 0.3) + torch.randn(D, generator=g)
    state = qz.fit(x)
    parts = qz.quantize(x, state)
    rows = tqc_rows(qz, state, 2, 1, torch.device("cpu"))
    assert rows.shape == (2, 1, 2 + 2 * D + 512)
    assert torch.equal(rows[..., :2], state["params"]) and torch.equal(rows[..., 2 : 2 + D], state["scale"])
    assert torch.equal(rows[..., 2 + D : 2 + 2 * D].view(torch.int32)[0, 0], tqc_channel_info(qz.widths))
    # the kernel's formula: one or two bytes at `byte`, shift, mask, level at base + code, times sigma
    p = torch.nn.functional.pad(parts["q"], (0, 1)).long()
    need2 = (shift + width) > 8
    word = p[..., byte] | torch.where(need2, p[..., byte + 1], 0) << 8
    code = (word >> shift) & ((1 << width) - 1)
    tile = levels[base + code] * rows[..., None, 2 : 2 + D]
    norm = torch.exp2(state["params"][..., 0, None, None] + state["params"][..., 1, None, None]
                      * (parts["norm"].float() - 1))  # fmt: skip
    assert torch.allclose(tile * norm, qz.decode_space(parts, state), rtol=1e-6, atol=1e-6)


def test_operand_and_cached_rows():
    """A tqc store is a kernel operand of kind KIND_TQC (no longer Unsupported); its rows are built once per state."""
    layer, _, _ = codebook_layer([KVPrecision(T4, "tq3"), "int8-token"], D=64, past=20, Tq=1)
    store = layer.groups[0].key
    op = operand(layer.snapshot().groups[0].key, 64, False)
    assert op.kind == KIND_TQC and op.data is store.parts["q"] and op.scale is store.parts["norm"]
    assert op.head_scale.shape == (2, 1, 2 + 2 * 64 + 512)
    assert operand(layer.snapshot().groups[0].key, 64, False).head_scale is op.head_scale  # cached (across snapshots)
    store.state = {**store.state, "params": store.state["params"].clone()}  # new state tensors (a reorder) rebuild
    assert operand(layer.snapshot().groups[0].key, 64, False).head_scale is not op.head_scale


# ------------------------------------------------------------------------------------- through dispatch
ROWS = {
    "tqc4-k/tq3-v,tqc3-k/tq4-v": [KVPrecision(T4, "tq3"), KVPrecision(T3, "tq4")],
    "tqc-k/tq4-v+int8": [KVPrecision(TR, "tq4"), "int8-token", KVPrecision("int8", "int8")],
    "tqc-kv+int4": [KVPrecision(T3, T4), KVPrecision("int4", "tq2")],
}


@pytest.mark.parametrize("row", list(ROWS), ids=str)
@pytest.mark.parametrize("option", ["plain", "sinks+residual", "residual-step1"], ids=str)
@pytest.mark.parametrize("Tq", [1, 3], ids=["decode", "chunk"])
def test_triton_reads_tqc_codes(row, option, Tq, monkeypatch):
    """Decode (Tq = 1) and chunk (Tq > 1) kernels read tqc codes, spreads, norms and levels through the block tables
    and match the torch block walk (tolerance of the tq* kernel tests) and the model-space fp32 reference: K/V
    asymmetric, tqc values too, mixed with int8 / int4 heads in the same layer (one launch per head group)."""
    layer, k, v = codebook_layer(ROWS[row], D=64, past=45, Tq=Tq, steps=(20,), **OPTIONS[option])
    assert layer.has_head_space
    q = torch.randn(2, 2 * layer.num_heads, Tq, 64, device=DEV)
    args = (q, k[:, :, 45:], v[:, :, 45:], layer, 45, None, 0.17)
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    walk = dispatch.attend(*args)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    no_fallback(monkeypatch)
    kinds = kernel_kinds(monkeypatch)
    out = dispatch.attend(*args)
    assert any(KIND_TQC in pair for pair in kinds) and len(kinds) == len(layer.groups)
    assert (out - walk).abs().max() <= 2e-4
    assert (out - model_space_reference(q, k, v, layer, 45, 0.17)).abs().max() <= 2e-4


@pytest.mark.parametrize("Tq", [1, 7], ids=["decode", "chunk"])
@pytest.mark.parametrize("block", [16, 32])
def test_shuffled_block_tables(Tq, block):
    """Through non-contiguous, out-of-order block tables with a partially filled last block (several decode
    partitions, 16-row chunk tiles), fp32 queries: within 1e-5 of the fp32 reference and of the torch walk. (The
    beam-shared blocks of tests/test_kernels_paged.py are left out: ``LayerStore.index_batch`` does not reorder the
    per-sequence state of codebook quantizers yet.)"""
    g = torch.Generator().manual_seed(11)
    row = [KVPrecision(T4, "tq4"), KVPrecision(TR, "tq3"), KVPrecision("int8-token", "int4")]
    layer = LayerStore(row, KVQuantConfig(block_size=block, sink_tokens=3, residual_tokens=9, residual_step=1),
                       64, 2, DEV)  # fmt: skip
    mag = torch.rand(1, 3, 1, 64, generator=g) * 2 + 0.25
    off = torch.randn(1, 3, 1, 64, generator=g) * 3

    def rnd(T):
        return (torch.randn(2, 3, T, 64, generator=g) * mag + off).to(DEV)

    layer.append(rnd(48), rnd(48))
    layer.append(rnd(23), rnd(23))
    shuffle_blocks(layer, 4)
    assert any(b - a != 1 for t in layer.tables for a, b in zip(t, t[1:], strict=False))  # not contiguous
    fk, fv = rnd(Tq), rnd(Tq)
    layer.append(fk, fv)
    past = 71
    assert layer.q_end == past + Tq - 9 and layer.q_end % block  # a partial last block in the pool
    fk, fv = layer.snapshot().space.kv_to_head(fk, fv)  # what dispatch hands the kernels (tqc: x - mu; tq*: rotated)
    q = layer.snapshot().space.query_to_head((torch.randn(2, 6, Tq, 64, generator=g) * 1.5).to(DEV))
    out = attend_triton(q, fk, fv, layer, past, None, 0.125, splits=3, block_m=16)
    ref = attend_naive(q, fk, fv, layer, past, None, 0.125)
    walk = attend_torch(q, fk, fv, layer, past, None, 0.125)
    assert (out - ref).abs().max().item() <= TOL
    assert (out - walk).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries(dtype):
    """fp16 / bf16 queries (half-precision MMAs, the tile split into high + low halves): the kernel adds nothing
    visible to the error of the torch path against the fp32 reference."""
    slack = 1e-4 if dtype == torch.float16 else 1e-3
    for past, Tq in ((60, 1), (33, 5)):
        layer, k, v = codebook_layer([KVPrecision(T4, "tq3"), KVPrecision(T3, T4)], D=64, past=past, Tq=Tq,
                                     steps=(20,))  # fmt: skip
        fk, fv = layer.snapshot().space.kv_to_head(k[:, :, past:], v[:, :, past:])
        q = torch.randn(2, 4, Tq, 64, device=DEV)
        out = attend_triton(q.to(dtype), fk.to(dtype), fv.to(dtype), layer, past, None, 0.125, splits=2, block_m=16)
        assert out.dtype == dtype
        ref = attend_naive(q.to(dtype).float(), fk.to(dtype).float(), fv.to(dtype).float(), layer, past, None, 0.125)
        walk = attend_torch(q.to(dtype), fk.to(dtype), fv.to(dtype), layer, past, None, 0.125)
        err = (out.float() - ref).abs().max().item()
        err_walk = (walk.float() - ref).abs().max().item()
        assert err <= err_walk + slack, f"Tq={Tq}: {err:.2e} vs torch path {err_walk:.2e}"


def test_dispatch_runs_tqc_layers_on_triton(monkeypatch, caplog):
    """A layer of tqc key heads (as the recommended configs hold) runs on the Triton kernels through dispatch: no
    fallback, no 'Triton attention unavailable' warning, every launch of a tqc group has K kind KIND_TQC."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    monkeypatch.setattr(dispatch, "_logged", set())
    no_fallback(monkeypatch)
    kinds = kernel_kinds(monkeypatch)
    layer, k, v = codebook_layer([KVPrecision(TR, "tq4"), KVPrecision(T4, "tq3"), KVPrecision("tq4", "tq4")],
                                 D=64, past=40, Tq=1, sink_tokens=4, residual_tokens=15, residual_step=1)  # fmt: skip
    q = torch.randn(2, 9, 1, 64, device=DEV)
    with caplog.at_level("WARNING", logger="kvquant"):
        out = dispatch.attend(q, k[:, :, 40:], v[:, :, 40:], layer, 40, None, 0.125)
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert sorted(kinds) == sorted([(KIND_TQC, 8), (KIND_TQC, 8), (8, 8)])
    assert (out - model_space_reference(q, k, v, layer, 40, 0.125)).abs().max() <= 2e-4


@pytest.mark.parametrize("D", [32, 128])
@pytest.mark.parametrize("Tq", [1, 4], ids=["decode", "chunk"])
def test_other_head_dims(D, Tq, monkeypatch):
    """head_dim 32 and 128 (rows of 16 / 64 bytes; 8-, 7-, 6-, 5-bit codes at shifting bit offsets): the kernels
    match the torch walk and the fp32 reference."""
    widths = ([8, 1, 7, 0, 5, 3, 6, 2] * (D // 8))[:D]
    widths[-1] += (-sum(widths)) % 8  # whole bytes per row
    layer, k, v = codebook_layer([KVPrecision(channel_precision(widths), "tq4"), "int8-token"], D=D, past=37, Tq=Tq,
                                 steps=(21,), sink_tokens=2, residual_tokens=5, residual_step=1)  # fmt: skip
    q = torch.randn(2, 4, Tq, D, device=DEV)
    args = (q, k[:, :, 37:], v[:, :, 37:], layer, 37, None, D**-0.5)
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    walk = dispatch.attend(*args)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    no_fallback(monkeypatch)
    out = dispatch.attend(*args)
    assert (out - walk).abs().max() <= 2e-4
    assert (out - model_space_reference(q, k, v, layer, 37, D**-0.5)).abs().max() <= 2e-4
