"""The error types of kvquant: every user error is one of them, and its message is one line naming the field,
option or file it is about.

The ``kvquant`` command line prints a :class:`KVQuantError` as ``kvquant COMMAND: error: MESSAGE`` and exits
with status 2; any other exception is a bug in kvquant and is shown with its traceback (exit status 1).
``--debug`` shows the traceback of user errors too.

All of them are ``ValueError`` subclasses, so ``except ValueError`` keeps catching them.
"""

from __future__ import annotations


class KVQuantError(ValueError):
    """A user error: bad config, recipe, option, input file, output path or device (one-line message)."""


class ConfigError(KVQuantError):
    """A config field is invalid; the message starts with the field's name."""


class RecipeError(KVQuantError):
    """An evaluation recipe field is invalid; the message starts with the field's name."""


class ArgumentError(KVQuantError):
    """A command-line option is invalid; the message starts with the option (``--samples: ...``)."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog  # the (sub)command it is about, when known: ``kvquant estimate``


class InputError(KVQuantError):
    """An input (file, model, data set) cannot be read or used; the message names it."""


class InputNotFoundError(InputError, FileNotFoundError):
    """An input file or folder does not exist (also a ``FileNotFoundError``)."""


class ModelError(InputError, TypeError):
    """A model kvquant cannot serve (not a transformers decoder using its AttentionInterface; also a ``TypeError``)."""


class OutputError(KVQuantError):
    """An output path would overwrite a file (without ``--force``), has the wrong kind, or cannot be written."""


class RequestError(KVQuantError):
    """A request given to :class:`kvquant.Scheduler` is invalid (prompt, sampling or id); the message names it."""


class DeviceError(KVQuantError):
    """A device that was asked for is not available (e.g. ``cuda`` without CUDA)."""


__all__ = [
    "ArgumentError",
    "ConfigError",
    "DeviceError",
    "InputError",
    "InputNotFoundError",
    "KVQuantError",
    "ModelError",
    "OutputError",
    "RecipeError",
    "RequestError",
]
