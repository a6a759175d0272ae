"""Rotated codebook quantizers, one scheme per module: ``tq{b}`` (:mod:`.scalar`), per-channel-width keys
``tqc-<widths>`` (:mod:`.channel`), 2-D vector codebooks ``tqv{b}`` (:mod:`.vector`); the shared table builders
(:mod:`.tables`), row helpers (:mod:`.rows`) and the age ladder's rungs (:mod:`.rungs`). The trellis codes
``tqt{b}`` are in :mod:`kvquant.quantizers.trellis`. How a codebook row is stored: :mod:`.scalar`."""

from __future__ import annotations

from ..intn import pack_codes, unpack_codes
from .channel import CHANNEL_PREFIX, SEARCH_SCALES, ChannelCodebook, channel_precision
from .rows import (
    GAINS,
    NORM_CODES,
    NORM_MARGIN,
    RSCALE_STEP,
    SHORT_CHUNK,
    SIGN_SEED,
    check_gain,
    code_of_norm,
    head_signs,
    norm_code_range,
    norm_of_code,
    pack_bits,
    row_gain,
    rscale_code,
    rscale_of_code,
    token_weights,
    unpack_bits,
)
from .rungs import Refinable, SecondRung, refinement_parts
from .scalar import Codebook
from .tables import (
    GAUSS_MAX_BITS,
    REFINE_ITERS,
    VQ_DIM,
    VQ_SAMPLES,
    VQ_SEED,
    allocate_widths,
    gaussian_distortion,
    gaussian_levels,
    gaussian_refined,
    gaussian_vq,
    lloyd_max_levels,
    refined_levels,
    refined_vq,
    uniform_levels,
    vq_nearest,
)
from .vector import VECTOR_PREFIX, VectorCodebook

__all__ = [
    "CHANNEL_PREFIX", "GAINS", "GAUSS_MAX_BITS", "NORM_CODES", "NORM_MARGIN", "REFINE_ITERS", "RSCALE_STEP",
    "SEARCH_SCALES", "SHORT_CHUNK", "SIGN_SEED", "VECTOR_PREFIX", "VQ_DIM", "VQ_SAMPLES", "VQ_SEED",
    "ChannelCodebook", "Codebook", "Refinable", "SecondRung", "VectorCodebook",
    "allocate_widths", "channel_precision", "check_gain", "code_of_norm", "gaussian_distortion", "gaussian_levels",
    "gaussian_refined", "gaussian_vq", "head_signs", "lloyd_max_levels", "norm_code_range", "norm_of_code",
    "pack_bits", "pack_codes", "refined_levels", "refined_vq", "refinement_parts", "row_gain", "rscale_code",
    "rscale_of_code", "token_weights", "uniform_levels", "unpack_bits", "unpack_codes", "vq_nearest",
]  # fmt: skip
