"""The age ladder's rungs of a codebook row: the first rung's parts and the second rung as a component."""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable

import torch

from ..base import Parts, PartSpec, Quantizer
from .rows import (
    pack_bits,
    unpack_bits,
)


def refinement_parts(head_dim: int) -> dict[str, PartSpec]:
    """The first rung's parts of every codebook precision: ``head_dim`` bits (``r``: one per coordinate, or
    ``tqv``'s one per coordinate of a pair's child) and the row's norm correction (``rscale``, :func:`rscale_code`)."""
    return {"r": PartSpec((head_dim // 8,), torch.uint8), "rscale": PartSpec((1,), torch.uint8)}


class SecondRung:
    """The age ladder's second rung (``ladder2_tokens``) of a quantizer with an embedded refinement: one more bit
    per coordinate of a refined row, the sign of the coordinate's residual against its refined value (in head
    space), which then moves by ``+- step2``, the mean absolute residual of the refined cell: the step that
    minimises the squared error of a sign bit. Embedded like the first rung: dropping the bit leaves the refined
    row. The row keeps its refined norm (no byte of its own): ``D / 8`` bytes a row.

    A component: it is given the host quantizer's head-space map ``to_space(x, state)``, refined decode
    ``decode_refined(parts, rparts, state)`` and per-coordinate step ``step2(parts, rparts, state)``, and reads
    nothing else of it."""

    def __init__(
        self,
        head_dim: int,
        to_space: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
        decode_refined: Callable[[Parts, Parts, dict[str, torch.Tensor]], torch.Tensor],
        step2: Callable[[Parts, Parts, dict[str, torch.Tensor]], torch.Tensor],
    ) -> None:
        self.head_dim = head_dim
        self.to_space = to_space
        self.decode_refined = decode_refined
        self.step2 = step2

    def parts(self) -> dict[str, PartSpec]:
        """One bit per coordinate (``r2``)."""
        return {"r2": PartSpec((self.head_dim // 8,), torch.uint8)}

    def refine(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts, rparts: Parts) -> Parts:
        """Second-rung parts of rows ``x`` whose base parts are ``parts`` and first-rung parts ``rparts``."""
        y = self.to_space(x, state)
        return {"r2": pack_bits((y >= self.decode_refined(parts, rparts, state)).long(), 1)}

    def add(
        self, y1: torch.Tensor, parts: Parts, rparts: Parts, r2parts: Parts, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Rows refined by both rungs from their refined decode ``y1``: ``y1 +- step2``."""
        sign = 2 * unpack_bits(r2parts["r2"], 1, self.head_dim) - 1
        return y1 + sign * self.step2(parts, rparts, state)


class Refinable(Quantizer):
    """A codebook quantizer whose rows the age ladder refines: the first rung is the subclass's own embedded
    refinement (``refine`` / ``decode_refined``, parts :func:`refinement_parts`), the second a :class:`SecondRung`
    it holds (:attr:`rung2`, built from the subclass's ``to_space``, ``decode_refined`` and ``step2``)."""

    @abstractmethod
    def to_space(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model-space rows -> head space (float32)."""

    @abstractmethod
    def refine(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts) -> Parts:
        """First-rung parts of rows ``x`` whose base parts are ``parts``."""

    @abstractmethod
    def decode_refined(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows refined by the first rung, float32 head space ``[B, H, T, D]``."""

    @abstractmethod
    def step2(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The second rung's step per coordinate (:class:`SecondRung`)."""

    @functools.cached_property
    def rung2(self) -> SecondRung:
        """The second rung, composed of this quantizer's head-space map, refined decode and step."""
        return SecondRung(self.head_dim, self.to_space, self.decode_refined, self.step2)

    def rung_parts(self, rung: int) -> dict[str, PartSpec]:
        """Both rungs: :func:`refinement_parts`, then one bit per coordinate (``r2``)."""
        if rung == 2:
            return self.rung2.parts()
        return refinement_parts(self.head_dim) if rung == 1 else {}

    def refine2(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts, rparts: Parts) -> Parts:
        """Second-rung parts of rows ``x`` (:meth:`SecondRung.refine`)."""
        return self.rung2.refine(x, state, parts, rparts)

    def decode_refined2(
        self, parts: Parts, rparts: Parts, r2parts: Parts, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Rows refined by both rungs, float32 head space ``[B, H, T, D]``: the refined row ``+- step2``."""
        return self.rung2.add(self.decode_refined(parts, rparts, state), parts, rparts, r2parts, state)

    def add_rung2(
        self, y1: torch.Tensor, parts: Parts, rparts: Parts, r2parts: Parts, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """:meth:`decode_refined2` from the rows' refined decode ``y1`` (already at hand: not decoded again)."""
        return self.rung2.add(y1, parts, rparts, r2parts, state)
