"""The quantizer interface: how one precision turns K or V rows into stored parts and back.

Every tensor passed around here has the layout ``[batch, heads, tokens, head_dim]``. A quantizer
names its *granularity* (which elements share one scale) and the *parts* it stores per token,
so that the block store can preallocate them and the kernels can read them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

Parts = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PartSpec:
    """One stored tensor of a quantizer: its per-token trailing shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    per_block: bool = False  # one row per block of tokens (per-channel scales), not per token


@dataclass(frozen=True)
class Factored:
    """Stored rows as ``codes * scale + zero`` without forming the product, so that attention can apply
    the scales to queries or probabilities instead of to every element of the history.

    * ``codes``: float32 ``[B, H, T, D]`` (the integer or fp8 codes, converted, nothing else applied).
    * ``scale``: ``None`` (1), ``[B or 1, H, 1, 1]`` (one per head) or ``[B, H, T, 1]`` (one per token);
    * with ``block > 0``: ``scale`` and ``zero`` are ``[B, H, T // block, D]``, one pair per channel and block of
      ``block`` tokens (asymmetric per-channel keys). ``zero`` is used only there.
    """

    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    block: int = 0


class Quantizer(ABC):
    """Quantizes a ``[B, H, T, D]`` tensor into named parts, one row per token.

    Subclasses set:
      * ``name``: the precision name used in configs (``int8``, ``int4``, ...).
      * ``granularity``: which elements share a scale, e.g. ``"per (layer, head)"``,
        ``"per token and head"``, ``"per token, group of 32 along head_dim"``.
      * ``static``: True when the scale is fixed per (layer, head) (set by ``calibrate``),
        False when scales are computed from each token as it is written.
    """

    name: str = "?"
    granularity: str = "?"
    static: bool = False
    # True when quantize acts head by head, with a state of one entry per head along its last axis and parts
    # that never widen: then K and V of a head group can be quantized in one pass, side by side on the head
    # axis (see kvquant.tensor_store.quantize_pair)
    pairable: bool = False
    per_block = False  # True: quantizes whole blocks of tokens at once (per-channel granularity)
    # True when quantize_counted raises ValueError (require_finite's) for NaN / Inf input on CPU, so a
    # store writing straight to this quantizer may skip its own check (kvquant.store.LayerStore.append)
    checks_finite = False
    space = False  # True: rows are read in a per-head rotated space (codebook quantizers, see ``fit``)
    center = False  # True: a space quantizer also removes a per-channel key mean in that space

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    # -- layout ---------------------------------------------------------------------------
    @abstractmethod
    def parts(self) -> dict[str, PartSpec]:
        """The tensors stored per token and head, e.g. ``{"q": PartSpec((D,), int8)}``."""

    def bits_per_element(self) -> float:
        """Average stored bits per K/V element, scale and zero-point overhead included."""
        return spec_bits(self.parts()) / self.head_dim

    def rung_parts(self, rung: int) -> dict[str, PartSpec]:
        """The parts one row of the age ladder holds per token and head at ``rung`` (1: ``refine``, 2:
        ``refine2``; see :mod:`kvquant.store`), on top of its base parts; ``{}``: this precision has no such rung. The
        store keeps ladder and heavy rows for a K or V exactly where this is non-empty (sizing counts them by it)."""
        return {}

    # -- static scales ----------------------------------------------------------------------
    def calibrate(self, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """Static state (e.g. one scale per head) from the absolute max ``amax[H]`` per head, or
        ``amax[B, H]`` per sequence and head (scales then broadcast as :func:`head_view`)."""
        return {}

    def per_sequence(self, name: str, t: torch.Tensor) -> bool:
        """Whether state entry ``name`` holds one row per sequence (leading axis = batch rows, which then
        follow beam search's reorders), as opposed to one entry per head shared by every sequence.
        Scales from :meth:`calibrate` are ``[B, H]`` per sequence and head, ``[H]`` per head."""
        return t.dim() == 2

    def fit(self, x: torch.Tensor, use: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
        """Static state per (sequence, head) fitted on the first chunk written, ``x[B, H, T, D]``, over the
        tokens where ``use[B, T]`` is True (None: all; returns None: use :meth:`calibrate`).

        Quantizers with ``space = True`` also provide ``to_space`` / ``query_to_space`` /
        ``from_space`` / ``decode_space`` (see :mod:`kvquant.quantizers.codebook`).
        """
        return None

    # -- math -------------------------------------------------------------------------------
    @abstractmethod
    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        """``x[B, H, T, D]`` (finite floats) -> parts ``{name: [B, H, T, *shape]}``."""

    @abstractmethod
    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Parts ``{name: [B, H, T, *shape]}`` -> ``[B, H, T, D]`` in ``dtype``."""

    def factored(self, parts: Parts, state: dict[str, torch.Tensor]) -> Factored | None:
        """The parts as :class:`Factored` (``dequantize(parts) == codes * scale + zero`` in float32), or None
        when the scales do not factor that way (e.g. groups along head_dim): then read :meth:`dequantize`."""
        return None

    def widen_scales(self) -> bool:
        """Store per-token / per-block scales and zeros in fp32 from now on (they overflowed fp16).

        Returns False when there is nothing to widen (no fp16 scale parts, or already fp32)."""
        return False

    def quantize_counted(
        self, x: torch.Tensor, state: dict[str, torch.Tensor], real: torch.Tensor | None = None
    ) -> tuple[Parts, torch.Tensor]:
        """:meth:`quantize` and the number of clipped values (static scales), not counting the tokens where
        ``real[B, T]`` is False (left padding). Subclasses may do both in one pass."""
        counted = x if real is None else torch.where(real[:, None, :, None], x, 0.0)
        return self.quantize(x, state), self.clipped(counted, state)

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """How many elements of ``x`` exceed the representable range (static scales only)."""
        return torch.zeros((), dtype=torch.int64, device=x.device)

    def describe(self) -> str:
        return f"{self.name} ({self.granularity})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(head_dim={self.head_dim}, granularity={self.granularity!r})"


def head_view(scale: torch.Tensor) -> torch.Tensor:
    """A static scale as a ``[B or 1, H, 1, 1]`` factor: ``[H]`` (one per head) or ``[B, H]`` (per sequence)."""
    return scale.view(1, -1, 1, 1) if scale.dim() == 1 else scale[..., None, None]


NON_FINITE = "key_states/value_states: NaN or Inf values cannot be quantized"


def require_finite(*tensors: torch.Tensor) -> float | None:
    """Raise ``ValueError`` if a tensor holds a NaN or an Inf. On CPU one min / max pass per tensor (NaN and
    Inf show in the extremes), and the largest magnitude found is returned; elsewhere an asynchronous device
    assert (no host synchronisation: it raises at the next one), and None."""
    if tensors[0].device.type == "cpu":
        ext = [e.item() for x in tensors if x.numel() for e in torch.aminmax(x)]
        if not all(math.isfinite(e) for e in ext):
            raise ValueError(NON_FINITE)
        return max((abs(e) for e in ext), default=0.0)
    ok = torch.isfinite(tensors[0]).all()
    for x in tensors[1:]:
        ok = ok & torch.isfinite(x).all()
    torch._assert_async(ok, NON_FINITE)
    return None


class WidenableScales:
    """Mixin for quantizers whose scale (and zero) parts are fp16 by default: ``scale_dtype`` becomes
    fp32 when a value overflows fp16 (|x| > 65504), see :meth:`Quantizer.widen_scales`."""

    scale_dtype: torch.dtype = torch.float16

    def widen_scales(self) -> bool:
        if self.scale_dtype == torch.float32:
            return False
        self.scale_dtype = torch.float32
        return True


def spec_bits(specs: dict[str, PartSpec]) -> int:
    """Bits of one row of every part in ``specs`` (per token and head)."""
    return sum(math.prod(spec.shape) * _dtype_bits(spec.dtype) for spec in specs.values())


def _dtype_bits(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 8
    if dtype.is_floating_point:
        return torch.finfo(dtype).bits
    return torch.iinfo(dtype).bits

