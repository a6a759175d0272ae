"""kvquant's Triton kernel launches as one torch custom op, ``torch.ops.kvquant.launch``.

Every kernel launch goes through :meth:`~kvquant.kernels.triton_launch.Launch.run`; when
:func:`enabled` (under ``torch.compile``, under a ``TorchDispatchMode`` such as ``make_fx`` /
``FakeTensorMode`` tracing, or with ``KVQUANT_TORCH_OPS=1`` at import) it calls :func:`launch`, which passes the
launch to the op. The op is registered with ``torch.library.triton_op`` (torch >= 2.6), so that
``torch.compile`` / ``make_fx`` see a decode step as a graph of tensor ops and ``kvquant.launch`` nodes,
without a graph break:

    launch(str kernel, SymInt[] grid, Tensor(a!)[] written, Tensor[] read, SymInt[] ints, float[] floats,
           bool[] flags, str names) -> ()

``kernel`` names the jit function (``"triton_decode_kernels._decode_partial"``: its module in
``kvquant.kernels`` and its name); ``names`` is ``;``-separated (the schema has no ``str[]``), its i-th
entry the kernel parameter (or launch option:
``num_warps``, ``num_stages``, ``maxnreg``) the i-th value of ``written + read + ints + floats + flags``
binds to, ``"A,B"`` when one tensor is passed to two parameters (the launchers pass dummies that way).
A tensor is ``written`` when one of its parameters is in :data:`WRITES` (the kernel's outputs), so the
op declares exactly the tensors the kernel stores to as mutated (``mutates_args``) and returns nothing;
a kernel missing from :data:`WRITES` has every tensor declared written (correct, only slower under
functionalisation: each is copied).

One generic op (not one per kernel): the schema does not depend on the kernel, so it is registered at
import, before ``torch.compile`` traces (registering an op while dynamo traces is a graph break), and
kernels added to the launchers need no registration. Fake implementation: ``triton_op`` traces the op's
body with fake tensors, where ``torch.library.wrap_triton`` turns the launch into Triton's
``triton_kernel_wrapper_mutation`` (which, with fake tensors, writes nothing: the op only mutates its
``written`` tensors). Interpreted kernels (``TRITON_INTERPRET=1``, CPU) cannot be wrapped: with fake
tensors the body then launches nothing, and under functionalisation (``aot_eager``) the op stays opaque
(``auto_functionalized``) instead of being decomposed into the kernel call.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

# each kernel's output parameters (the pointers it stores to); the test checks them against the kernels
WRITES: dict[str, tuple[str, ...]] = {
    "triton_decode_kernels._decode_partial": ("O_PART", "LSE_PART"),
    "triton_decode_kernels._decode_partial_t": ("O_PART", "LSE_PART"),
    "triton_rows._decode_partial_rows": ("O_PART", "LSE_PART"),
    "triton_rows._decode_partial_rows_t": ("O_PART", "LSE_PART"),
    "triton_decode_kernels._decode_reduce": ("OUT", "LSE_OUT"),
    "triton_chunk._chunk_attn": ("OUT", "LSE_OUT"),
}
OPTIONS = ("num_warps", "num_stages", "maxnreg")  # launch options the launchers may pass
AVAILABLE = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")


def kernel_name(kernel: Any) -> str:
    """``"<module in kvquant.kernels>.<name>"`` of a jit function (compiled or interpreted)."""
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"


_kernels: dict[str, Any] = {}


def kernel_by_name(name: str) -> Any:
    """The jit function :func:`kernel_name` names."""
    kernel = _kernels.get(name)
    if kernel is None:
        module, _, attr = name.rpartition(".")
        kernel = getattr(importlib.import_module(f"kvquant.kernels.{module}"), attr)
        _kernels[name] = kernel
    return kernel


def interpreted_kernel(kernel: Any) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


# KVQUANT_TORCH_OPS=1 / 0 (read at import): every launch through the op / none (not even under a dispatch mode)
FORCE: bool | None = {"1": True, "0": False}.get(os.environ.get("KVQUANT_TORCH_OPS", ""))


def enabled() -> bool:
    """True when launches go through the op: while ``torch.compile`` traces; else :data:`FORCE` if set;
    else while a ``TorchDispatchMode`` is active (``make_fx``, ``FakeTensorMode``). About 1 us."""
    if not AVAILABLE:
        return False
    if torch.compiler.is_compiling():
        return True
    if FORCE is not None:
        return FORCE
    return _get_current_dispatch_mode() is not None


def _launch_impl(
    kernel: str,
    grid: list[int],
    written: list[torch.Tensor],
    read: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    flags: list[bool],
    names: str,
) -> None:
    jit = kernel_by_name(kernel)
    values = [*written, *read, *ints, *floats, *flags]
    names = names.split(";")
    if len(values) != len(names):
        raise ValueError(f"kvquant.launch {kernel}: {len(values)} values, {len(names)} names")
    bound: dict[str, Any] = {}
    for value, name in zip(values, names, strict=True):
        for param in name.split(","):
            bound[param] = value
    if interpreted_kernel(jit):
        from torch._subclasses.fake_tensor import FakeTensor

        tensors = [*written, *read]
        if any(isinstance(t, FakeTensor) for t in tensors):
            return  # the fake implementation: the kernel only writes ``written`` in place
        odd = [type(t).__name__ for t in tensors if type(t) not in (torch.Tensor, torch.nn.Parameter)]
        if odd:
            raise RuntimeError(f"kvquant.launch {kernel}: an interpreted kernel (TRITON_INTERPRET=1) runs on plain "
                               f"tensors, got {odd[0]}")  # fmt: skip
        call = jit
    else:
        call = torch.library.wrap_triton(jit)
    params = jit.arg_names
    options = {k: bound.pop(k) for k in OPTIONS if k in bound}
    call[tuple(grid)](**{p: bound[p] for p in params if p in bound}, **options)


# torch < 2.6 has no triton_op: launches then stay direct (enabled() is False)
launch_op = torch.library.triton_op("kvquant::launch", _launch_impl, mutates_args={"written"}) if AVAILABLE else None


def _register_functional_rule() -> None:
    """Under functionalisation (``aot_eager``, inductor) ``triton_op`` decomposes the op into its body (Triton's
    ``triton_kernel_wrapper_functional``), which needs a compiled kernel; an interpreted kernel is kept as the
    opaque op instead (``auto_functionalized``: ``written`` copied, launched on the copies, copied back)."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    decompose = getattr(launch_op, "_torch_dispatch_fns", {}).get(FunctionalTensorMode)
    if decompose is None:  # this torch keeps it elsewhere: interpreted kernels are then not functionalised
        return

    def rule(mode, op, types, args, kwargs):
        if interpreted_kernel(kernel_by_name(args[0] if args else kwargs["kernel"])):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        return decompose(mode, op, types, args, kwargs)

    launch_op.register_torch_dispatch(FunctionalTensorMode, rule)


if AVAILABLE:
    _register_functional_rule()


def op_arguments(launch) -> tuple:
    """The op's arguments for ``launch`` (a :class:`~kvquant.kernels.triton_launch.Launch`)."""
    name = kernel_name(launch.kernel)
    params = launch.kernel.arg_names
    if len(launch.args) > len(params):
        raise TypeError(f"{name}: {len(launch.args)} positional arguments, the kernel takes {len(params)}")
    outs = WRITES.get(name)
    bound = {**dict(zip(params, launch.args, strict=False)), **launch.meta}
    # one entry per tensor object and its parameters, matched by identity (`is`: torch.compile before 2.13
    # cannot trace id() of a tensor made inside the compiled region)
    tensors: list[tuple[torch.Tensor, list[str]]] = []
    scalars: dict[type, tuple[list, list[str]]] = {int: ([], []), float: ([], []), bool: ([], [])}
    for param, value in bound.items():
        if param not in params and param not in OPTIONS:
            raise TypeError(f"{name}: unknown parameter {param!r}")
        if isinstance(value, torch.Tensor):
            same = [ps for t, ps in tensors if t is value]
            if same:
                same[0].append(param)
            else:
                tensors.append((value, [param]))
        elif type(value) in scalars:
            values, names = scalars[type(value)]
            values.append(value)
            names.append(param)
        elif value is not None:  # None: a launch option left to its default
            raise TypeError(f"{name}: parameter {param!r} of type {type(value).__name__} (kvquant.launch takes "
                            "tensors, int, float, bool)")  # fmt: skip
    written: tuple[list, list[str]] = ([], [])
    read: tuple[list, list[str]] = ([], [])
    for t, ps in tensors:
        side = written if outs is None or any(p in outs for p in ps) else read
        side[0].append(t)
        side[1].append(",".join(ps))
    (ints, int_names), (floats, float_names), (flags, flag_names) = scalars.values()
    names = ";".join(written[1] + read[1] + int_names + float_names + flag_names)
    return name, list(launch.grid), written[0], read[0], ints, floats, flags, names


def launch(launch) -> None:
    """Run ``launch`` through ``torch.ops.kvquant.launch``."""
    torch.ops.kvquant.launch(*op_arguments(launch))


__all__ = ["AVAILABLE", "WRITES", "enabled", "kernel_by_name", "kernel_name", "launch", "op_arguments"]
