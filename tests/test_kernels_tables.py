"""Table codebooks read in-kernel by the Triton decode and chunk kernels (interpreter on CPU): 2-D vector codes
``tqv2/3/4`` and trellis codes ``tqt2/3/4``. The host-side rows against each quantizer's own packing / decoding
(tqv3's byte-crossing 6-bit codes, tqt's windows that wrap around the row), the kernels against the torch block walk
and the fp32 reference (every width, keys with tq3 / int8 values, values too, beside int8 / int4 / tq heads, sinks +
residual incl. residual_step 1, shuffled block tables, half-precision queries, head_dim 32 / 128), and dispatch
running these layers on Triton instead of falling back to torch. Each dispatch test runs once per family (``fam``:
its precisions are ``{fam}2/3/4``)."""

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
from kvquant.kernels.triton_attention import attend_triton  # noqa: E402
from kvquant.kernels.triton_codebook import KIND_CODEBOOK, KIND_TQT, KIND_TQV, table_rows, tqv_rows  # noqa: E402
from kvquant.kernels.triton_dequant import KIND_TOKEN, operand  # noqa: E402
from kvquant.quantizers import TrellisCodebook, VectorCodebook  # noqa: E402
from kvquant.store import LayerStore  # noqa: E402
from tests.test_codebook import OPTIONS, codebook_layer, model_space_reference  # noqa: E402
from tests.test_kernels_paged import shuffle_blocks  # noqa: E402
from tests.test_kernels_tqc import kernel_kinds, no_fallback  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5  # fp32 queries, against the fp32 reference on the same stored rows


# ------------------------------------------------------------------------------------------- host side
def stored(qz, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state, parts) of ``qz`` for rows ``[2, 3, 9, D]`` with per-channel spreads and offsets."""
    D = qz.head_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 9, D, generator=g) * (torch.rand(D, generator=g) + 0.3) + torch.randn(D, generator=g)
    state = qz.fit(x)
    return state, qz.quantize(x, state)


def norm_of(parts: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The row norms the kernels compute from the 8-bit log codes: ``2^(lo + step (c - 1))``."""
    p = state["params"]
    return torch.exp2(p[..., 0, None, None] + p[..., 1, None, None] * (parts["norm"].float() - 1))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rows_match_the_quantizers_packing(bits):
    """The kernels' row (norm range, codewords) and their per-channel formula (pair ``j // 2``'s code at bit
    ``(j // 2) * 2b``, one or two bytes, shift, mask, coordinate ``j % 2`` of its codeword), emulated in torch, give
    :meth:`VectorCodebook.decode_space` / norm."""
    D = 64
    qz = VectorCodebook(D, bits)
    state, parts = stored(qz, seed=bits)
    rows = tqv_rows(qz, state, 2, 3, torch.device("cpu"))
    assert rows.shape == (2, 3, 2 + 2 ** (2 * bits + 1))
    assert torch.equal(rows[..., :2], state["params"])
    assert torch.equal(rows[0, 1, 2:].view(-1, 2), qz.codewords)
    W = 2 * bits
    j = torch.arange(D)
    start = (j // 2) * W
    byte, shift = start // 8, start % 8
    p = torch.nn.functional.pad(parts["q"], (0, 1)).long()
    word = p[..., byte] | torch.where(shift + W > 8, p[..., byte + 1], 0) << 8
    code = (word >> shift) & ((1 << W) - 1)
    tile = torch.gather(rows[..., None, 2:].expand(*code.shape[:3], -1), 3, 2 * code + j % 2)
    norm = norm_of(parts, state)
    assert torch.allclose(tile * norm, qz.decode_space(parts, state), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fam, kind, width", [("tqv", KIND_TQV, 2 + 2**7), ("tqt", KIND_TQT, 2 + 2**9)])
def test_operand_and_cached_rows(fam, kind, width):
    """A tqv3 / tqt3 store is a kernel operand of its kind (not Unsupported); its rows are built once per state."""
    layer, _, _ = codebook_layer([KVPrecision(f"{fam}3", "tq3"), "int8-token"], D=64, past=20, Tq=1)
    store = layer.groups[0].key
    op = operand(layer.snapshot().groups[0].key, 64, False)
    assert op.kind == kind and op.bits == 3 and op.data is store.parts["q"] and op.scale is store.parts["norm"]
    assert op.head_scale.shape == (2, 1, width)
    assert operand(layer.snapshot().groups[0].key, 64, False).head_scale is op.head_scale  # cached (across snapshots)
    store.state = {**store.state, "params": store.state["params"].clone()}  # new state tensors (a reorder) rebuild
    assert operand(layer.snapshot().groups[0].key, 64, False).head_scale is not op.head_scale


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tqt_rows_match_the_quantizers_decoding(bits):
    """The kernels' row (norm range, trellis table) and their per-channel formula (the ``b + 6``-bit window ending at
    bit ``b (j + 1)`` of the circular stream: three bytes from its first, wrapping, shifted, masked; then a table
    lookup), emulated in torch, give :meth:`TrellisCodebook.decode_space` / norm."""
    D = 64
    qz = TrellisCodebook(D, bits)
    state, parts = stored(qz, seed=bits)
    rows = table_rows(qz, state, 2, 3, torch.device("cpu"), qz.table)
    L = bits + 6
    assert rows.shape == (2, 3, 2 + 2**L) and qz.state_bits == L
    assert torch.equal(rows[..., :2], state["params"])
    assert torch.equal(rows[0, 1, 2:], qz.table)
    RB = bits * D // 8
    j = torch.arange(D)
    start = (bits * (j + 1) - L) % (bits * D)
    byte = start // 8
    p = parts["q"].long()
    word = p[..., byte] | p[..., (byte + 1) % RB] << 8 | p[..., (byte + 2) % RB] << 16
    st = (word >> (start % 8)) & ((1 << L) - 1)
    tile = torch.gather(rows[..., None, 2:].expand(*st.shape[:3], -1), 3, st)
    norm = norm_of(parts, state)
    assert torch.allclose(tile * norm, qz.decode_space(parts, state), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- through dispatch
KIND = {"tqv": KIND_TQV, "tqt": KIND_TQT}
FAMILIES = pytest.mark.parametrize("fam", list(KIND))
ROWS = {  # "X" stands for the family
    "X3-k/tq3-v+int8": [("X3", "tq3"), ("int8-token", "int8-token")],
    "X4-k/int8-v,X2-k/tq4-v": [("X4", "int8-token"), ("X2", "tq4")],
    "X-kv+int4": [("X3", "X4"), ("int4", "X2")],
}


def row_of(spec: list[tuple[str, str]], fam: str) -> list[KVPrecision]:
    return [KVPrecision(k.replace("X", fam), v.replace("X", fam)) for k, v in spec]


@FAMILIES
@pytest.mark.parametrize("row", list(ROWS), ids=str)
@pytest.mark.parametrize("option", ["plain", "sinks+residual", "residual-step1"], ids=str)
@pytest.mark.parametrize("Tq", [1, 3], ids=["decode", "chunk"])
def test_triton_reads_table_codes(fam, row, option, Tq, monkeypatch):
    """Decode (Tq = 1) and chunk (Tq > 1) kernels read tqv / tqt codes, norms and tables through the block tables
    and match the torch block walk (tolerance of the tq* / tqc kernel tests) and the model-space fp32 reference: K/V
    asymmetric, values too, mixed with int8 / int4 / tq heads in the same layer (one launch per head group)."""
    layer, k, v = codebook_layer(row_of(ROWS[row], fam), D=64, past=45, Tq=Tq, steps=(20,), **OPTIONS[option])
    assert layer.has_head_space
    q = torch.randn(2, 2 * layer.num_heads, Tq, 64, device=DEV)
    args = (q, k[:, :, 45:], v[:, :, 45:], layer, 45, None, 0.17)
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    walk = dispatch.attend(*args)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    no_fallback(monkeypatch)
    kinds = kernel_kinds(monkeypatch)
    out = dispatch.attend(*args)
    assert any(KIND[fam] in pair for pair in kinds) and len(kinds) == len(layer.groups)
    assert (out - walk).abs().max() <= 2e-4
    assert (out - model_space_reference(q, k, v, layer, 45, 0.17)).abs().max() <= 2e-4


@FAMILIES
@pytest.mark.parametrize("Tq", [1, 7], ids=["decode", "chunk"])
@pytest.mark.parametrize("block", [16, 32])
def test_shuffled_block_tables(fam, Tq, block):
    """Through non-contiguous, out-of-order block tables with a partially filled last block (several decode
    partitions, 16-row chunk tiles), fp32 queries: within 1e-5 of the fp32 reference and of the torch walk."""
    g = torch.Generator().manual_seed(12)
    row = row_of([("X3", "X4"), ("X2", "tq3"), ("int8-token", "X3")], fam)
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
    fk, fv = layer.snapshot().space.kv_to_head(fk, fv)  # what dispatch hands the kernels (rotated, as for tq*)
    q = layer.snapshot().space.query_to_head((torch.randn(2, 6, Tq, 64, generator=g) * 1.5).to(DEV))
    out = attend_triton(q, fk, fv, layer, past, None, 0.125, splits=3, block_m=16)
    ref = attend_naive(q, fk, fv, layer, past, None, 0.125)
    walk = attend_torch(q, fk, fv, layer, past, None, 0.125)
    assert (out - ref).abs().max().item() <= TOL
    assert (out - walk).abs().max().item() <= TOL


@FAMILIES
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries(fam, dtype):
    """fp16 / bf16 queries (half-precision MMAs, the tile split into high + low halves): the kernel adds nothing
    visible to the error of the torch path against the fp32 reference."""
    slack = 1e-4 if dtype == torch.float16 else 1e-3
    for past, Tq in ((60, 1), (33, 5)):
        row = row_of([("X4", "X3"), ("X3", "tq3")], fam)
        layer, k, v = codebook_layer(row, D=64, past=past, Tq=Tq, steps=(20,))
        fk, fv = layer.snapshot().space.kv_to_head(k[:, :, past:], v[:, :, past:])
        q = torch.randn(2, 4, Tq, 64, device=DEV)
        out = attend_triton(q.to(dtype), fk.to(dtype), fv.to(dtype), layer, past, None, 0.125, splits=2, block_m=16)
        assert out.dtype == dtype
        ref = attend_naive(q.to(dtype).float(), fk.to(dtype).float(), fv.to(dtype).float(), layer, past, None, 0.125)
        walk = attend_torch(q.to(dtype), fk.to(dtype), fv.to(dtype), layer, past, None, 0.125)
        err = (out.float() - ref).abs().max().item()
        err_walk = (walk.float() - ref).abs().max().item()
        assert err <= err_walk + slack, f"Tq={Tq}: {err:.2e} vs torch path {err_walk:.2e}"


@FAMILIES
def test_dispatch_runs_table_layers_on_triton(fam, monkeypatch, caplog):
    """A layer of tqv / tqt key heads (X3-k with tq3 / int8 values, as the lowbit configs hold) runs on the Triton
    kernels through dispatch: no fallback, no 'Triton attention unavailable' warning, every launch of such a group
    has its K kind."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    monkeypatch.setattr(dispatch, "_logged", set())
    no_fallback(monkeypatch)
    kinds = kernel_kinds(monkeypatch)
    row = row_of([("X3", "tq3"), ("X3", "int8-token"), ("tq3", "tq3")], fam)
    layer, k, v = codebook_layer(row, D=64, past=40, Tq=1, sink_tokens=4, residual_tokens=15, residual_step=1)
    q = torch.randn(2, 9, 1, 64, device=DEV)
    with caplog.at_level("WARNING", logger="kvquant"):
        out = dispatch.attend(q, k[:, :, 40:], v[:, :, 40:], layer, 40, None, 0.125)
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    kf = KIND[fam]
    assert sorted(kinds) == sorted([(kf, KIND_CODEBOOK), (kf, KIND_TOKEN), (KIND_CODEBOOK, KIND_CODEBOOK)])
    assert (out - model_space_reference(q, k, v, layer, 40, 0.125)).abs().max() <= 2e-4


@FAMILIES
@pytest.mark.parametrize("D", [32, 128])
@pytest.mark.parametrize("Tq", [1, 4], ids=["decode", "chunk"])
def test_other_head_dims(fam, D, Tq, monkeypatch):
    """head_dim 32 and 128 (X3 rows of 12 / 48 bytes, X2 / X4 values): the kernels match the torch walk and the fp32
    reference."""
    row = row_of([("X3", "X2"), ("X4", "int8-token")], fam)
    layer, k, v = codebook_layer(row, D=D, past=37, Tq=Tq, steps=(21,), sink_tokens=2, residual_tokens=5,
                                 residual_step=1)  # fmt: skip
    q = torch.randn(2, 4, Tq, D, device=DEV)
    args = (q, k[:, :, 37:], v[:, :, 37:], layer, 37, None, D**-0.5)
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    walk = dispatch.attend(*args)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    no_fallback(monkeypatch)
    out = dispatch.attend(*args)
    assert (out - walk).abs().max() <= 2e-4
    assert (out - model_space_reference(q, k, v, layer, 37, D**-0.5)).abs().max() <= 2e-4
