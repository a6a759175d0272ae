"""Each config field's own bounds (``_FIELD_CHECKS``), checked on construction and on every assignment."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from ..quantizers import (
    CHANNEL_PREFIX,
    CODEBOOK,
    GAINS,
    TRELLIS,
    VECTOR,
)
from .fields import (
    MAX_GROUP_SIZE,
    MAX_HEADROOM,
    MAX_RESIDUAL_TOKENS,
    MAX_SINK_TOKENS,
    check_int,
)


def _is_codebook(precision: str) -> bool:
    return precision in CODEBOOK or precision in VECTOR or precision in TRELLIS or precision.startswith(CHANNEL_PREFIX)


def _check_group_size(gs: Any) -> None:
    if gs is not None and (
        not isinstance(gs, int) or isinstance(gs, bool) or not 0 < gs <= MAX_GROUP_SIZE or gs & (gs - 1)
    ):
        raise ConfigError(f"group_size: {gs!r} must be a power of two from 1 to {MAX_GROUP_SIZE}")


def _check_headroom(hr: Any) -> None:
    if (
        not isinstance(hr, (int, float)) or isinstance(hr, bool) or not math.isfinite(hr)
        or not 1.0 <= hr <= MAX_HEADROOM
    ):
        raise ConfigError(f"headroom: {hr!r} must be a number from 1.0 to {MAX_HEADROOM:g}")


def _check_block_size(bs: Any) -> None:
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 16 or bs > 4096 or bs & (bs - 1):
        raise ConfigError(f"block_size: {bs!r} must be a power of two between 16 and 4096")


def _check_choice(name: str, choices: tuple[str, ...]) -> Any:
    def check(value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} must be one of {', '.join(choices)}")

    return check


def _check_bool(name: str, optional: bool = False) -> Any:
    def check(value: Any) -> None:
        if not isinstance(value, bool) and not (optional and value is None):
            raise ConfigError(f"{name}: {value!r} must be true{', false or null' if optional else ' or false'}")

    return check


def _check_tokens(name: str, hi: int) -> Any:
    return lambda value: check_int(value, name, 0, hi)


def _check_residual_step(value: Any) -> None:
    if value is not None:
        check_int(value, "residual_step", 1, 4096)


def _check_scales_file(value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"scales_file: {value!r} must be a path")


#: each field's own bounds, checked on construction and on every assignment (constraints between fields are
#: checked by ``_check_options``)
_FIELD_CHECKS: dict[str, Any] = {
    "group_size": _check_group_size,
    "headroom": _check_headroom,
    "block_size": _check_block_size,
    "rotate": _check_choice("rotate", ("none", "keys", "kv")),
    "sink_tokens": _check_tokens("sink_tokens", MAX_SINK_TOKENS),
    "residual_tokens": _check_tokens("residual_tokens", MAX_RESIDUAL_TOKENS),
    "residual_step": _check_residual_step,
    "ladder_tokens": _check_tokens("ladder_tokens", MAX_RESIDUAL_TOKENS),
    "ladder2_tokens": _check_tokens("ladder2_tokens", MAX_RESIDUAL_TOKENS),
    "heavy_tokens": _check_tokens("heavy_tokens", MAX_RESIDUAL_TOKENS),
    "share_kv_scale": _check_bool("share_kv_scale"),
    "check_finite": _check_bool("check_finite"),
    "codebook_search": _check_bool("codebook_search"),
    "center_keys": _check_bool("center_keys", optional=True),
    "codebook_gain": _check_choice("codebook_gain", tuple(GAINS)),
    "scales_file": _check_scales_file,
}
