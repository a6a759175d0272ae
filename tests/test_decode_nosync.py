"""The decode attention step makes no host synchronisation (so it can be captured in a CUDA graph).

A ``TorchDispatchMode`` rejects every op that needs a tensor's value on the host
(``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, ``if t:``; ``nonzero``/``masked_select``
and other data-dependent shapes; ``equal``). The decode step (``kvquant.kernels.dispatch.attend`` with
``Tq == 1``) runs under it with the torch path, and with the Triton dispatch with the kernel
launches mocked (on CPU the interpreter would read tensors through numpy, outside the dispatcher):
the launches are recorded and their grids checked to depend on the pool's capacity only. Through the
custom op ``kvquant::launch`` (the default under a dispatch mode) the kernels run unmocked, one opaque
op each.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvquant.config import KVPrecision, KVQuantConfig
from kvquant.kernels import dispatch
from kvquant.store import LayerStore

SYNCING = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select",
    "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "argwhere",
}  # fmt: skip


class HostSync(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSync` on any op whose result needs a device value on the host; ``seen``: the ops."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func._schema.name)
        name = func._schema.name.split("::")[-1]
        if name in SYNCING:
            raise HostSync(f"host synchronisation: aten.{name}")
        return func(*args, **(kwargs or {}))


def _layer(option: dict, past: int, B: int = 2, capacity: int = 256):
    option = dict(option)
    row = option.pop("row", [KVPrecision("int8", "int4"), KVPrecision("int4", "int8-token"),
                             KVPrecision("fp8-e4m3", "int8")])  # fmt: skip
    cfg = KVQuantConfig(block_size=16, **option)
    layer = LayerStore(row, cfg, 64, B, torch.device("cpu"), capacity=capacity)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, B, 3, past + 1, 64, generator=g)
    layer.append(k[:, :, :past], v[:, :, :past])
    layer.append(k[:, :, past:], v[:, :, past:])
    return layer, k[:, :, past:], v[:, :, past:]


def _mask(B: int, past: int) -> torch.Tensor:
    j = torch.arange(past + 1).view(1, 1, 1, -1)
    pad = torch.tensor([0, 5])[:B].view(-1, 1, 1, 1)
    return j >= pad


OPTIONS = {
    "plain": {},
    "sinks+residual": {"sink_tokens": 4, "residual_tokens": 16},
    # codebook heads (their head space) with an age ladder: the ring's rows decoded on the dense side
    "codebook+ladder": {
        "row": [KVPrecision("tq3", "tqv3"), KVPrecision("tqv3", "tq2"), KVPrecision("int8-token", "tq3")],
        "sink_tokens": 4, "residual_tokens": 5, "residual_step": 1, "ladder_tokens": 12,
    },
}


def test_detector_sees_a_sync():
    with pytest.raises(HostSync), NoHostSync():
        bool(torch.ones(2).sum() > 0)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "left-pad"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_decode_torch_path_no_sync(monkeypatch, option, masked):
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    layer, fk, fv = _layer(OPTIONS[option], past=70)
    q = torch.randn(2, 6, 1, 64)
    mask = _mask(2, 70) if masked else None
    with NoHostSync():
        out = dispatch.attend(q, fk, fv, layer, 70, mask, 0.125)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "left-pad"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_decode_triton_dispatch_no_sync(monkeypatch, option, masked):
    pytest.importorskip("triton")
    from kvquant.kernels import triton_attention
    from kvquant.kernels.triton_launch import Launch

    if not triton_attention.interpreted():
        pytest.skip("the Triton dispatch on CPU needs the interpreter's kernels")
    launches: list[Launch] = []
    monkeypatch.setattr(Launch, "run", lambda self: launches.append(self))
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    served = []
    real = triton_attention.attend_triton
    monkeypatch.setattr(triton_attention, "attend_triton", lambda *a, **k: served.append(1) or real(*a, **k))
    grids = []
    for past in (70, 101):  # two steps, same pool capacity
        layer, fk, fv = _layer(OPTIONS[option], past=past)
        q = torch.randn(2, 6, 1, 64)
        mask = _mask(2, past) if masked else None
        launches.clear()
        with NoHostSync():
            dispatch.attend(q, fk, fv, layer, past, mask, 0.125)
        assert launches and served[-1:] == [1]  # the Triton path served it (no fallback)
        grids.append([ln.grid for ln in launches])
    assert grids[0] == grids[1]  # the grid depends on the capacity, not on the length


def test_decode_step_with_append_no_sync(monkeypatch):
    """A whole layer's decode step (append the token, attend) with ``check_finite`` off; with it on, the
    CPU check reads the flag on the host (on CUDA it is an asynchronous device-side assert)."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    cfg = KVQuantConfig(block_size=16, check_finite=False)
    layer = LayerStore([KVPrecision("int4", "int8-token")] * 2, cfg, 64, 2, torch.device("cpu"), capacity=128)
    k, v = torch.randn(2, 2, 2, 41, 64)
    layer.append(k[:, :, :40], v[:, :, :40])
    with NoHostSync():
        past = layer.append(k[:, :, 40:], v[:, :, 40:])
        dispatch.attend(torch.randn(2, 4, 1, 64), k[:, :, 40:], v[:, :, 40:], layer, past, None, 0.125)
    layer.config = KVQuantConfig(block_size=16)
    with pytest.raises(HostSync), NoHostSync():
        layer.append(k[:, :, 40:], v[:, :, 40:])


@pytest.mark.parametrize("option", list(OPTIONS))
def test_decode_through_custom_ops_no_sync(monkeypatch, option):
    """Under a ``TorchDispatchMode`` the launches go through the custom op ``kvquant::launch``
    (:mod:`kvquant.kernels.custom_ops`): the kernels run for real (no mock), each one opaque op to the mode,
    and the step (the op's argument packing included) reads nothing on the host; same result as the direct
    launches."""
    pytest.importorskip("triton")
    from kvquant.kernels import custom_ops, triton_attention

    if not triton_attention.interpreted() or not custom_ops.AVAILABLE:
        pytest.skip("needs the interpreter's kernels and torch.library.triton_op")
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    layer, fk, fv = _layer(OPTIONS[option], past=70)
    q = torch.randn(2, 6, 1, 64)
    mask = _mask(2, 70)
    monkeypatch.setattr(custom_ops, "FORCE", False)
    direct = dispatch.attend(q, fk, fv, layer, 70, mask, 0.125)
    monkeypatch.setattr(custom_ops, "FORCE", None)
    mode = NoHostSync()
    with mode:
        out = dispatch.attend(q, fk, fv, layer, 70, mask, 0.125)
    assert mode.seen.count("kvquant::launch") == len(layer.groups) + 1  # each head group + the reduction
    assert torch.equal(out, direct)
