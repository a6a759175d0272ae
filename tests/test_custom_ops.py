"""The kernel launches as the torch custom op ``kvquant.launch`` (:mod:`kvquant.kernels.custom_ops`).

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before they are imported):

* through the op, a decode step gives exactly (bitwise) the result of the direct launches;
* the op declares as mutated exactly the tensors each kernel writes (every tensor argument is compared
  before and after a direct launch), and ``torch.library.opcheck`` (schema + fake tensor) passes;
* ``torch.compile(fullgraph=True)`` (dynamo; and ``aot_eager``-style AOTAutograd, where the op is
  ``auto_functionalized``) and ``make_fx`` (fake tensors) trace a whole decode step (``dispatch.attend``:
  block table, ranges, launches, dense-segment merge, codebook head space) into one graph with the
  launches as opaque ``kvquant.launch`` nodes: no graph break, no host read; the compiled step gives the
  eager result;
* with the compiled jit functions (subprocess, ``meta`` tensors) the op's fake implementation traces the
  launch through ``torch.library.wrap_triton`` (``triton_kernel_wrapper_mutation``).

Not verified here (no GPU): the compiled kernels' decomposition under functionalisation
(``triton_kernel_wrapper_functional``, what inductor compiles), inductor's launches, CUDA graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from kvquant.config import KVPrecision, KVQuantConfig  # noqa: E402
from kvquant.kernels import custom_ops, dispatch  # noqa: E402
from kvquant.kernels.triton_attention import interpreted  # noqa: E402
from kvquant.kernels.triton_launch import Launch  # noqa: E402
from kvquant.store import LayerStore  # noqa: E402

if not custom_ops.AVAILABLE:
    pytest.skip("torch.library.triton_op is not available in this torch", allow_module_level=True)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = {
    "int8": ["int8", "int8"],
    "int4": ["int4", "int4"],
    "tq4+int8": [KVPrecision("tq4", "tq3"), "int8-token"],  # a codebook head and a per-token int8 head
}
OPTIONS = {"plain": {}, "sinks+residual": {"sink_tokens": 3, "residual_tokens": 16}}


def make_step(row: str, option: str = "plain", past: int = 45, B: int = 2, masked: bool = False):
    """A store holding ``past`` tokens and one decode step's inputs: ``(layer, q, fresh_k, fresh_v, mask)``."""
    g = torch.Generator().manual_seed(0)
    prec = [r if isinstance(r, KVPrecision) else KVPrecision(r, r) for r in ROWS[row]]
    layer = LayerStore(prec, KVQuantConfig(block_size=16, **OPTIONS[option]), 64, B, DEV, capacity=128)
    H = len(prec)
    k, v = (torch.randn(2, B, H, past + 1, 64, generator=g) * 2).to(DEV)
    layer.append(k[:, :, :past], v[:, :, :past])
    layer.append(k[:, :, past:], v[:, :, past:])
    q = torch.randn(B, 2 * H, 1, 64, generator=g).to(DEV)
    mask = None
    if masked:  # row 1 left-padded by 5
        mask = (torch.arange(past + 1).view(1, 1, 1, -1) >= torch.tensor([0, 5])[:B].view(-1, 1, 1, 1)).to(DEV)
    return layer, q, k[:, :, past:], v[:, :, past:], mask


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    if DEV.type == "cpu" and not interpreted():
        pytest.skip("the Triton kernels on CPU need the interpreter")
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    monkeypatch.setattr(custom_ops, "FORCE", None)


def _attend(layer, q, fk, fv, mask, past):
    return dispatch.attend(q, fk, fv, layer, past, mask, 0.125)


def test_schema():
    schema = torch.ops.kvquant.launch.default._schema
    mutable = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutable == ["written"] and not schema.returns


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "left-pad"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("row", list(ROWS))
def test_op_launches_equal_direct_launches(monkeypatch, row, option, masked):
    """The decode step through ``torch.ops.kvquant.launch`` is bitwise the step with direct launches."""
    layer, q, fk, fv, mask = make_step(row, option, masked=masked)
    monkeypatch.setattr(custom_ops, "FORCE", False)
    direct = _attend(layer, q, fk, fv, mask, 45)
    calls = []
    real = custom_ops.launch
    monkeypatch.setattr(custom_ops, "launch", lambda ln: calls.append(ln.name) or real(ln))
    monkeypatch.setattr(custom_ops, "FORCE", True)
    via_op = _attend(layer, q, fk, fv, mask, 45)
    assert calls and calls[-1] == "_decode_reduce"  # the launches went through the op
    assert torch.equal(direct, via_op)


def _recorded_launches(monkeypatch, row: str, option: str = "plain", Tq: int = 1) -> list[Launch]:
    """The launches of one attention step (decode, or a ``Tq``-token chunk), recorded, not run."""
    launches: list[Launch] = []
    layer, q, fk, fv, mask = make_step(row, option, masked=True)
    if Tq > 1:
        q, fk, fv = q.expand(-1, -1, Tq, -1).contiguous(), fk.expand(-1, -1, Tq, -1), fv.expand(-1, -1, Tq, -1)
        mask = torch.ones(2, 1, Tq, 45 + Tq, dtype=torch.bool, device=DEV)
    with monkeypatch.context() as m:
        m.setattr(Launch, "run", lambda self: launches.append(self))
        _attend(layer, q, fk, fv, mask, 45)
    return launches


@pytest.mark.parametrize("Tq", [1, 3], ids=["decode", "chunk"])
@pytest.mark.parametrize("row", list(ROWS))
def test_declared_writes_are_the_kernels_writes(monkeypatch, row, Tq):
    """Every tensor a kernel changes is passed as ``written`` (declared mutated): each tensor argument is
    compared before and after a direct launch (on NaN-filled outputs, so that each output is written)."""
    launches = _recorded_launches(monkeypatch, row, "sinks+residual", Tq)
    assert launches
    for launch in launches:
        assert custom_ops.kernel_name(launch.kernel) in custom_ops.WRITES, launch.name  # no pessimistic fallback
        _, _, written, read, *_ = custom_ops.op_arguments(launch)
        for t in written:
            t.fill_(float("nan"))
        before = [t.clone() for t in read]
        launch.run()
        for t, b in zip(read, before, strict=True):
            torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True, msg=launch.name)
        assert all(not t.isnan().all() for t in written), launch.name


def test_opcheck(monkeypatch):
    """``torch.library.opcheck``: the schema (no undeclared mutation or aliasing) and the fake implementation
    (fake tensors in, the declared outputs unchanged in shape) on a real decode launch of each kernel."""
    for launch in _recorded_launches(monkeypatch, "int4"):
        torch.library.opcheck(torch.ops.kvquant.launch.default, custom_ops.op_arguments(launch),
                              test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def _graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's calls (``kvquant.launch``: dynamo records the op packet, make_fx its overload)."""
    return [str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


HOST_READS = ("item", "tolist", "aten._local_scalar_dense", "aten.nonzero", "aten.item")


@pytest.mark.parametrize(("row", "option", "masked"), [("int8", "plain", True), ("int4", "plain", False),
                                                       ("tq4+int8", "sinks+residual", True)])  # fmt: skip
def test_torch_compile_fullgraph_decode_step(row, option, masked):
    """``torch.compile(fullgraph=True)`` traces the whole decode step (no graph break: a host read would be
    one) into one graph whose launches are ``kvquant.launch`` nodes; running it gives the eager result."""
    layer, q, fk, fv, mask = make_step(row, option, masked=masked)
    eager = _attend(layer, q, fk, fv, mask, 45)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda q, fk, fv, mask: _attend(layer, q, fk, fv, mask, 45), backend=backend,
                         fullgraph=True)  # fmt: skip
    out = step(q, fk, fv, mask)
    assert len(graphs) == 1
    ops = _graph_ops(graphs[0])
    assert ops.count("kvquant.launch") == len(layer.groups) + 1, ops  # one per head group + the reduction
    assert not set(ops) & set(HOST_READS), ops
    assert torch.equal(out, eager)


def test_torch_compile_decode_loop():
    """Decode steps with an append between them (the store's block-table cache rebuilt from its Python block
    lists inside the traced step) each trace with ``fullgraph=True`` and give the eager result. The graph
    specialises on the length (``past_len`` and the store's ``q_end`` are Python ints): one graph per step."""
    layer, q, fk, fv, _ = make_step("int8", past=30)
    g = torch.Generator().manual_seed(1)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda q, fk, fv, past: _attend(layer, q, fk, fv, None, past), backend=backend,
                         fullgraph=True)  # fmt: skip
    past, stale = 30, []
    for _ in range(3):  # tokens 31, 32, 33: the second opens a new pool block
        k, v = torch.randn(2, 2, 2, 1, 64, generator=g).to(DEV)
        fk.copy_(k)
        fv.copy_(v)
        past = layer.append(fk, fv)
        stale.append(layer._table_cache is None)  # then rebuilt inside the compiled step
        out = step(q, fk, fv, past)
        assert torch.equal(out, _attend(layer, q, fk, fv, None, past))
    assert len(graphs) == 3 and any(stale)


def test_aot_eager_decode_step():
    """With functionalisation (``aot_eager``: AOTAutograd, what inductor gets) the interpreted kernels' op stays
    opaque, ``auto_functionalized`` (its ``written`` tensors copied, launched on the copies, copied back): one
    graph, the eager result. (Compiled kernels are decomposed into ``triton_kernel_wrapper_functional``
    instead: GPU only.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    layer, q, fk, fv, mask = make_step("tq4+int8", "sinks+residual", masked=True)
    eager = _attend(layer, q, fk, fv, mask, 45)
    graphs = []

    def forward(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    step = torch.compile(lambda q, fk, fv, mask: _attend(layer, q, fk, fv, mask, 45),
                         backend=aot_autograd(fw_compiler=forward), fullgraph=True)  # fmt: skip
    out = step(q, fk, fv, mask)
    assert len(graphs) == 1
    launches = [n for n in graphs[0].graph.nodes if "kvquant.launch" in str(n.args[0] if n.args else "")]
    assert len(launches) == len(layer.groups) + 1 and all("auto_functionalized" in str(n.target) for n in launches)
    assert torch.equal(out, eager)


def test_make_fx_decode_step():
    """``make_fx`` with fake tensors: the decode step as aten ops and ``kvquant.launch`` nodes, nothing run."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layer, q, fk, fv, mask = make_step("int4", "sinks+residual", masked=True)
    gm = make_fx(lambda q, fk, fv, mask: _attend(layer, q, fk, fv, mask, 45), tracing_mode="fake",
                 _allow_non_fake_inputs=True)(q, fk, fv, mask)  # fmt: skip
    ops = _graph_ops(gm)
    assert ops.count("kvquant.launch") == 2, ops
    assert not set(ops) & set(HOST_READS), ops
    kernels = [n.args[0] for n in gm.graph.nodes if str(n.target) == "kvquant.launch.default"]
    assert kernels[0].startswith(("triton_decode_kernels._decode_partial", "triton_rows._decode_partial"))
    assert kernels[1] == "triton_decode_kernels._decode_reduce"


COMPILED_TRACE = r"""
import torch
import torch._higher_order_ops.triton_kernel_wrap as wrap
from torch.fx.experimental.proxy_tensor import make_fx
from kvquant.kernels import custom_ops
hop_calls = []
hop = type(wrap.triton_kernel_wrapper_mutation)
hop_call = hop.__call__
hop.__call__ = lambda self, *a, **k: hop_calls.append(1) or hop_call(self, *a, **k)
from kvquant.kernels.triton_compile_check import meta_launches
# fp16 queries (the GPU's decode launches): an int8 / int4 head group each (int4: maxnreg set), the reduction
pairs = [("int8", "int8", 2), ("int4", "int4", 2)]
launches = meta_launches("decode", pairs, 1, 128, 4, True, past_len=1000, capacity=1024)
launches += meta_launches("reduce", pairs, 1, 128, 4, True, past_len=1000, capacity=1024)
assert type(launches[0].kernel).__name__ == "JITFunction" and any("maxnreg" in ln.meta for ln in launches)
def step():
    for launch in launches:
        custom_ops.launch(launch)
gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)()
print(sum(str(n.target) == "kvquant.launch.default" for n in gm.graph.nodes), len(hop_calls))
"""


def test_compiled_kernels_fake_path_traces():
    """With the compiled jit functions (no interpreter; the launches ``decode_launches`` builds on ``meta``
    tensors, no GPU), the op's fake implementation is ``triton_op``'s own: the body traced with fake tensors,
    the launch through ``torch.library.wrap_triton`` as ``triton_kernel_wrapper_mutation``."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", COMPILED_TRACE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["3", "3"], res.stdout  # three op nodes, each traced wrap_triton's HOP
