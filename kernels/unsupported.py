"""``Unsupported``: raised by a Triton launcher for inputs it cannot serve (the torch path takes over).

A module of its own so that the kernels and the dispatcher that falls back on it both import it,
and not each other."""

from __future__ import annotations


class Unsupported(Exception):
    """Raised by a Triton launcher for inputs it cannot serve; the torch path takes over."""
