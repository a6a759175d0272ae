"""One kernel launch as data, and its ahead-of-time compilation exactly as Triton's runtime would do it.

A launcher (:func:`~kvquant.kernels.triton_decode.decode_launches`) describes each launch as a
:class:`Launch`: the jit function, the grid, the positional arguments and the constexpr / option
keywords. Running it is ``kernel[grid](*args, **meta)``. :func:`compile_launch` compiles the same
launch for a CUDA target without a GPU: it binds the arguments with Triton's own runtime binder
(the function ``JITFunction.run`` uses), so the specialisation is the runtime's -- integer
arguments equal to 1 become constants, pointers and integers divisible by 16 get the
``tt.divisibility`` hint, dtypes come from the tensors -- and then calls ``triton.compile`` with the
same options. Tensors may live on the ``meta`` device (address 0: aligned, as CUDA allocations are),
so a 128K-token pool costs nothing to describe.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Launch:
    """``kernel[grid](*args, **meta)``: one launch of a Triton kernel."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict = field(default_factory=dict)

    def run(self) -> None:
        """Launch it (compiled on a GPU, interpreted on CPU under ``TRITON_INTERPRET=1``); through the torch
        custom op ``kvquant.launch`` while traced (``torch.compile``, ``make_fx``): :mod:`.custom_ops`."""
        from . import custom_ops

        if custom_ops.enabled():
            return custom_ops.launch(self)
        self.kernel[self.grid](*self.args, **self.meta)

    @property
    def name(self) -> str:
        fn = getattr(self.kernel, "fn", self.kernel)
        return getattr(fn, "__name__", "kernel")


def compile_launch(launch: Launch, arch: int = 90):
    """Compile ``launch`` for ``sm_<arch>`` (``sm_90a`` for 90) as the runtime would; no GPU needed.

    Returns Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``). Raises
    whatever the compiler raises. Needs compiled (not interpreted) jit functions.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if not hasattr(fn, "params"):
        raise TypeError(f"{launch.name}: not a compiled jit function (unset TRITON_INTERPRET)")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.meta)
    # the option keywords JITFunction.run adds before binding (those this triton version has)
    kwargs["debug"] = kwargs.get("debug", getattr(fn, "debug", None)) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _nvidia_tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin (``nvdisasm -c``: code only, branch targets as ``.L_x_N`` labels)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_nvidia_tool("nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Per-thread registers (``REG``), stack and local memory (spills: Triton uses no local arrays) and
    static shared memory of the cubin's kernel, from ``cuobjdump -res-usage`` (the binary itself)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    line = next((ln for ln in text.splitlines() if "REG:" in ln), "")
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
    if "reg" not in usage:
        raise RuntimeError(f"cuobjdump -res-usage: no REG in {text[:200]!r}")
    return usage
