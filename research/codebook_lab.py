"""Fast teacher-forced lab for codebook KV configs (issue 14): which knob buys quality, before an exact-decode run.

    python research/codebook_lab.py tq4:tq4:1 tq4:tq4:16 tq4:tq3:32 --key-weight none,query --windows 4

One forward per window replaces ~64 one-token decode steps: every attention layer of SmolLM2-135M
(fp32, WikiText-2 test, windows of 1024 tokens) is replaced by an attention in which query ``t``
sees the *decode-equivalent* history: keys/values ``j <= t - R`` (not the 4 sink tokens) as
stored by the codebook quantizer (:class:`~kvquant.quantizers.Codebook`, its static state fitted
on the first 960 tokens, like the recipe's prefill), the newest ``R`` ones (itself included) exact,
like an ``R``-token residual window. Positions 512..1023 are scored against the unquantized model:
KL(reference || config) and Δppl %, with one standard error over windows. Its numbers are *not* the
acceptance protocol (exact decode, ``research/recipes/lowbit-smollm2.yaml``); they rank configs (they read
~1.5x higher KL than exact decode scored on the last 64 tokens).

``--key-weight query`` also tries a query-aware linear map of each key head before the codebook,
``k' = A (k - mu)``, ``q' = A^-T q`` (scores exact): ``A^T A = Ck^-1 # Cq`` (matrix geometric mean of the
inverse key covariance and the query second moment of that head's query group), the map that
minimises the expected score error of an isotropic quantization error. ``query`` is an oracle (fitted
on the scored window itself); ``calib`` fits the same map per (layer, KV head) on ``--calib-windows``
windows from the END of the corpus (what a stored calibration would hold); ``calib-diag`` / ``query-diag``
keep only the diagonals (a per-channel scale). ``--value-weight calib`` maps each value head likewise,
``v' = B v``, ``B^T B = Cv^-1 # G`` with ``G`` the output projection's metric for that head's query group
(:func:`output_metric`). Nothing is stored; these say what such a map could buy.

Specs: ``K:V:R`` with widths 2/3/4 or ``exact`` (quantize only K or only V: where the KL comes from), or
``CONFIG.yaml:R``: the per-(layer, KV head) codebook widths (``tqc`` heads included) a kvquant config
assigns (its other precisions read as exact). ``--layers 0-14`` quantizes only those layers. ``--model
smollm2-135m+kbias`` runs a stress variant; ``--key-trend linear`` removes a per-channel linear trend over
positions (fitted on the prefill) from the keys before coding, a test of whether a RoPE-turned key offset
is what costs there (it was not: lowbit-kbias.md). ``--key-space pre-rope`` codes each key *before* its rotary
embedding (KVQuant's pre-RoPE keys: a key channel's mean and spread do not turn with the position there), then
turns the decoded key back; a config's ``tqc`` heads get their widths re-allocated there (:func:`pre_rope_widths`,
same bits per head, from the ``--calib-windows``). The store does not do this (it holds post-RoPE keys: a kernel
would have to turn each decoded key by its position); the lab says what it would buy.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import rotate_half

from kvquant import KVQuantConfig, ModelShape
from kvquant.models import load_model
from kvquant.quantizers import (
    CHANNEL_PREFIX,
    CODEBOOK,
    TRELLIS,
    VECTOR,
    Codebook,
    Quantizer,
    TrellisCodebook,
    VectorCodebook,
    allocate_widths,
    channel_precision,
    make_quantizer,
)
from kvquant.text import load_text, tokenize

WINDOW, PREFILL, SINK, SCORE_FROM = 1024, 960, 4, 512


def _psd_power(c: torch.Tensor, p: float) -> torch.Tensor:
    e, u = torch.linalg.eigh(c)
    return (u * e.clamp_min(1e-9 * e.max()) ** p) @ u.T


def moments(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head ``(Ck, Cq)`` ``[H, D, D]`` (float64) of one window: centered key covariance and the query
    second moment of the head's query group, over the prefill's non-sink tokens."""
    _, hq, _, d = q.shape
    h = k.shape[1]
    kk = k[0, :, SINK:PREFILL].double()
    kk = kk - kk.mean(1, keepdim=True)
    ck = kk.transpose(1, 2) @ kk / kk.shape[1]
    qq = q[0, :, SINK:PREFILL].double().reshape(h, -1, d)
    cq = qq.transpose(1, 2) @ qq / qq.shape[1]
    return ck, cq


def map_from_moments(ck: torch.Tensor, cq: torch.Tensor, diag: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head ``(A, A^-1)`` ``[H, D, D]``: ``A^T A = Ck^-1 # Cq`` (see the module doc); ``diag``: the same
    with both moments reduced to their diagonals (a per-channel scale)."""
    d = ck.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    out, inv = [], []
    for c_k, c_q in zip(ck, cq, strict=True):
        if diag:
            w = (c_q.diagonal().clamp_min(1e-12) / c_k.diagonal().clamp_min(1e-12)) ** 0.25
            out.append(torch.diag(w).float())
            inv.append(torch.diag(1 / w).float())
            continue
        c_k = c_k + 1e-6 * c_k.diagonal().mean() * eye
        c_q = c_q + 1e-6 * c_q.diagonal().mean() * eye
        ki = torch.linalg.inv(c_k)
        a, ai = _psd_power(ki, 0.5), _psd_power(ki, -0.5)
        m = a @ _psd_power(ai @ c_q @ ai, 0.5) @ a  # Ck^-1 # Cq
        root = _psd_power(m, 0.5)
        out.append(root.float())
        inv.append(torch.linalg.inv(root).float())
    return torch.stack(out), torch.stack(inv)


def output_metric(o_proj: torch.Tensor, kv_heads: int, d: int) -> torch.Tensor:
    """Per KV head ``G = sum_j W_j^T W_j`` ``[H, D, D]`` (float64) over its query heads' slices ``W_j`` of the
    output projection ``o_proj[hidden, Hq * D]``: the metric in which a value error reaches the residual stream."""
    w = o_proj.detach().double().view(o_proj.shape[0], -1, d)  # [hidden, Hq, D]
    hq = w.shape[1]
    g = torch.einsum("nja,njb->jab", w, w)  # [Hq, D, D]
    return g.view(kv_heads, hq // kv_heads, d, d).sum(1)


def query_weight(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head ``(A, A^-1)`` ``[H, D, D]`` from the window's own queries and keys (the oracle)."""
    return map_from_moments(*moments(q, k))


GAIN = {"gain": "unbiased", "search": True}  # the codebooks' row gain (--gain), tqc's row-scale search (--search)


def _quantizer(width: int | str, d: int) -> Quantizer:
    """``3`` -> ``tq3``; ``"v3"`` -> ``tqv3`` (2-D vector codebook); ``"t3"`` -> ``tqt3`` (trellis);
    ``"tqc-..."`` -> that per-channel code;
    with the row gain of ``--gain`` (and ``tqc``'s row-scale search of ``--search``)."""
    if isinstance(width, str) and width.startswith(CHANNEL_PREFIX):
        return make_quantizer(width, d, gain=GAIN["gain"], search=GAIN["search"])
    if isinstance(width, str) and width.startswith("v"):
        return VectorCodebook(d, int(width[1:]), gain=GAIN["gain"])
    if isinstance(width, str) and width.startswith("t"):
        return TrellisCodebook(d, int(width[1:]), gain=GAIN["gain"])
    return Codebook(d, int(width), gain=GAIN["gain"])


def _width(token: str) -> int | str:
    """A spec's width: ``3`` / ``tq3`` -> 3, ``exact`` -> 0, ``v3`` / ``tqv3`` -> ``"v3"``, ``tqt3`` -> ``"t3"``."""
    token = token.replace("tq", "")
    if token == "e":
        return "e"
    return 0 if token == "exact" else token if token.startswith(("v", "t")) else int(token)


def fake_quantize(x: torch.Tensor, bits: int | str | list[int | str], embedded: int = 0) -> torch.Tensor:
    """``x[1, H, T, D]`` through a codebook quantizer fitted on the prefill's non-sink tokens (bits 0: exact;
    ``"v3"``: the 2-D vector codebook ``tqv3``); ``bits`` per head (a list) groups the heads by width, like
    the store's head groups. ``embedded``: the base code plus its embedded refinement (one more bit per
    coordinate, ``Codebook.refine`` / ``decode_refined``), what the store's age-ladder ring holds; ``2``: with the
    store's second rung too (``refine2`` / ``decode_refined2``, ``ladder2_tokens``; a width without it: the first)."""
    per_head = bits if isinstance(bits, list) else [bits] * x.shape[1]
    out = x.float().clone()
    for b in sorted(set(per_head) - {0}, key=str):
        idx = torch.tensor([h for h, w in enumerate(per_head) if w == b])
        xs = x.float().index_select(1, idx)
        qz = _quantizer(b, x.shape[-1])
        state = qz.fit(xs[:, :, SINK:PREFILL])
        parts = qz.quantize(xs, state)
        if embedded:
            rp = qz.refine(xs, state, parts)
            if embedded == 2 and hasattr(qz, "refine2"):
                y = qz.decode_refined2(parts, rp, qz.refine2(xs, state, parts, rp), state)
            else:
                y = qz.decode_refined(parts, rp, state)
            out[:, idx] = qz.from_space(y, state)
        else:
            out[:, idx] = qz.dequantize(parts, state, torch.float32)
    return out


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool = False) -> torch.Tensor:
    """transformers' rotary embedding of ``x`` (``x cos + rotate_half(x) sin``); ``back``: its inverse."""
    return x * cos - rotate_half(x) * sin if back else x * cos + rotate_half(x) * sin


def pre_rope_widths(widths: str, e_q: torch.Tensor, var_k: torch.Tensor) -> str:
    """A ``tqc-<widths>`` head's bits re-allocated over its pre-RoPE key channels: weights ``E[q_j^2] var(k_j)``
    with ``e_q`` averaged over each channel's RoPE partner (a pair's energy turns with the position)."""
    bits = sum(int(c) for c in widths[len(CHANNEL_PREFIX):])
    e = (e_q + e_q.roll(e_q.shape[-1] // 2, -1)) / 2  # channel j's RoPE partner is j +- D/2
    return channel_precision(allocate_widths(e * var_k, bits))


def second_refinement(x: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """``x1`` (a refined row's decode) moved by a second sign bit per coordinate: ``x1 + sign(x - x1) * step``, with
    ``step`` each (head, channel)'s mean ``|x - x1|`` over the prefill's non-sink rows. A lab proxy for a second
    ladder rung (the store would code it in the head space, like the first bit); 8 more bytes a row."""
    res = x.float() - x1.float()
    return x1.float() + torch.sign(res) * res[:, :, SINK:PREFILL].abs().mean(2, keepdim=True)


def linear_trend(x: torch.Tensor) -> torch.Tensor:
    """``a + s t`` per (head, channel) of ``x[1, H, T, D]``, least squares over the prefill's non-sink positions ``t``
    (a slowly turning RoPE offset, e.g. a pre-RoPE key bias, is close to linear in the position), at every position."""
    t = torch.arange(x.shape[2], dtype=torch.float64)
    xs, ts = x[:, :, SINK:PREFILL].double(), t[SINK:PREFILL]
    tc = ts - ts.mean()
    slope = (xs * tc[:, None]).sum(2, keepdim=True) / (tc * tc).sum()
    a = xs.mean(2, keepdim=True) - slope * ts.mean()
    return (a + slope * t[:, None]).float()


class Lab:
    """The model with its attention replaced by the decode-equivalent quantized attention."""

    def __init__(self, windows: int, calib_windows: int = 0, layers: set[int] | None = None,
                 model: str = "smollm2-135m", first: int = 0, pre_rope: bool = False) -> None:  # fmt: skip
        lm = load_model(model, dtype="float32", progress=False)
        self.trend = False  # --key-trend linear: a per-channel linear trend over positions removed before coding
        self.pre_rope = pre_rope  # --key-space pre-rope: keys coded before their rotary embedding
        self.rotary = getattr(lm.model.model, "rotary_emb", None)  # None: a model without RoPE (no pre-rope mode)
        if pre_rope and self.rotary is None:
            raise SystemExit(f"--key-space pre-rope: {model} has no rotary embedding")
        self.pre_stats: dict[int, list[torch.Tensor]] = {}  # per layer [E q_j^2, var k_pre_j] [H, D] (calibration)
        self.model = lm.model
        ids = tokenize(load_text("wikitext-2").text, lm.tokenizer)
        if (first + windows) * WINDOW > len(ids):
            raise SystemExit(f"--first-window {first} --windows {windows}: the text holds {len(ids) // WINDOW} windows")
        self.windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(first, first + windows)]
        self.layers = layers  # quantize only these layers (None: all)
        self.spec: tuple[int, int, int, str] | None = None
        self.sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self.attention
        # calibration: key / query moments per (layer, KV head) on windows from the END of the corpus
        self.calib: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.maps: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.recording = False
        self.mid: tuple[int, int | str] = (0, 0)  # (tokens, width) of the age ladder's middle rung (--mid)
        self.ladder2 = 0  # --ladder2: the youngest of the --mid rows that keep a second refinement bit
        self.store_rung2 = False  # --store-rung2: that bit as the store codes it (refine2), not the lab proxy
        self.lognormal_fix = False  # --lognormal-fix: see lognormal
        self.score_scale = 1.0  # --score-scale: every quantized row's score times this (a temperature probe)
        self.ladder3 = 0  # --ladder3: the youngest of the --ladder2 rows with a third bit (lab proxy)
        self.heavy: tuple[int, int, str] = (0, 1, "sum")  # --heavy N:RUNG:SCORE: prompt rows refined by attention
        self.refs = [self.log_probs(w) for w in self.windows]
        if calib_windows:
            self.recording = True
            n = len(ids) // WINDOW
            for i in range(n - calib_windows, n):
                self.log_probs(ids[i * WINDOW:(i + 1) * WINDOW])
            self.recording = False

    def attention(self, module, q, k, v, mask, scaling=None, **kw):  # noqa: ANN001 (transformers' signature)
        layer = module.layer_idx
        if self.recording:
            ck, cq = moments(q, k)
            cv, _ = moments(q, v)
            if layer in self.calib:
                ck, cq, cv = ck + self.calib[layer][0], cq + self.calib[layer][1], cv + self.calib[layer][2]
            self.calib[layer] = (ck, cq, cv)
            if self.pre_rope:
                kp = self.unrope(k)[0, :, SINK:PREFILL].double()
                st = [q[0, :, SINK:PREFILL].double().reshape(k.shape[1], -1, k.shape[-1]).pow(2).mean(1), kp.var(1)]
                prev = self.pre_stats.get(layer)
                self.pre_stats[layer] = st if prev is None else [a + b for a, b in zip(prev, st, strict=True)]
        if self.spec is None or (self.layers is not None and layer not in self.layers):
            return self.sdpa(module, q, k, v, mask, scaling=scaling, **kw)
        kb, vb, r, weight, vweight = self.spec
        kb = kb[layer] if isinstance(kb, dict) else kb
        vb = vb[layer] if isinstance(vb, dict) else vb
        b, hq, t, d = q.shape
        h = k.shape[1]
        if weight in ("query", "calib", "calib-diag", "query-diag"):
            if weight.startswith("calib"):
                key = (weight, layer)
                if key not in self.maps:
                    self.maps[key] = map_from_moments(*self.calib[layer][:2], diag=weight.endswith("diag"))
                a, ai = self.maps[key]
            else:
                a, ai = map_from_moments(*moments(q, k), diag=weight.endswith("diag"))
            mu = k[:, :, SINK:PREFILL].mean(2, keepdim=True)
            kw_ = torch.einsum("bhtd,hed->bhte", k.float() - mu, a)
            kh = torch.einsum("bhte,hde->bhtd", fake_quantize(kw_, kb), ai) + mu
        elif self.trend:
            trend = linear_trend(k)
            kh = fake_quantize(k.float() - trend, kb) + trend
        else:
            kh = self.code_keys(k, kb)
        if vweight.startswith("calib"):
            key = ("v" + vweight, layer)
            if key not in self.maps:
                self.maps[key] = map_from_moments(self.calib[layer][2], output_metric(module.o_proj.weight, h, d),
                                                  diag=vweight.endswith("diag"))  # fmt: skip
            bm, bi = self.maps[key]
            vw = torch.einsum("bhtd,hed->bhte", v.float(), bm)
            vh = torch.einsum("bhte,hde->bhtd", fake_quantize(vw, vb), bi)
        else:
            vh = fake_quantize(v, vb)
        pos = torch.arange(t)
        causal = pos[None, :] <= pos[:, None]
        exact = (pos[None, :] > pos[:, None] - r) | (pos[None, :] < SINK)
        qf = q.float().view(b, h, hq // h, t, d)
        s = torch.where(exact, torch.einsum("bhgtd,bhsd->bhgts", qf, k.float()),
                        torch.einsum("bhgtd,bhsd->bhgts", qf, kh)) * scaling  # fmt: skip
        s = torch.where(exact, s, s * self.score_scale)  # --score-scale (1: none)
        lb = self.lognormal(qf, k, kh, scaling)
        p = torch.softmax(torch.where(exact, s, s - lb).masked_fill(~causal, -math.inf), -1)
        if self.mid[0]:  # an age ladder: the mid[0] tokens just past the exact window at width mid[1]
            mid = (pos[None, :] > pos[:, None] - r - self.mid[0]) & ~exact
            if self.mid[1] == "e":  # embedded: the base widths plus one refinement bit per coordinate
                km = k if kb == 0 else self.code_keys(k, kb, embedded=1)
                vm = v if vb == 0 else fake_quantize(v, vb, embedded=1)
            else:
                km = k if kb == 0 else fake_quantize(k, self.mid[1])
                vm = v if vb == 0 else fake_quantize(v, self.mid[1])
            s = torch.where(mid, torch.einsum("bhgtd,bhsd->bhgts", qf, km.float()) * scaling, s)
            # --ladder2: the youngest of those rows with a second refinement bit (see second_refinement)
            young = mid & (pos[None, :] > pos[:, None] - r - self.ladder2)
            if self.ladder2:
                if self.store_rung2:
                    km2 = k if kb == 0 else self.code_keys(k, kb, embedded=2)
                    vm2 = v if vb == 0 else fake_quantize(v, vb, embedded=2)
                else:
                    km2 = k if kb == 0 else second_refinement(k, km)
                    vm2 = v if vb == 0 else second_refinement(v, vm)
                s = torch.where(young, torch.einsum("bhgtd,bhsd->bhgts", qf, km2.float()) * scaling, s)
            young3 = mid & (pos[None, :] > pos[:, None] - r - self.ladder3)
            if self.ladder3:  # a third sign bit on the youngest rows (lab proxy on top of the second rung)
                km3 = k if kb == 0 else second_refinement(k, km2)
                vm3 = v if vb == 0 else second_refinement(v, vm2)
                s = torch.where(young3, torch.einsum("bhgtd,bhsd->bhgts", qf, km3.float()) * scaling, s)
            heavy = self.heavy_rows(qf, k, scaling) & ~(exact | mid)  # --heavy: [b, h, 1, 1, t] & [t, t]
            if self.heavy[0]:
                kx, vx = (km, vm) if self.heavy[1] == 1 else (km2, vm2)
                s = torch.where(heavy, torch.einsum("bhgtd,bhsd->bhgts", qf, kx.float()) * scaling, s)
            s = torch.where(mid, s * self.score_scale, s)  # (the rows just replaced, unscaled)
            if self.lognormal_fix:  # each row class's own correction
                corr = torch.where(mid, self.lognormal(qf, k, km, scaling), lb)
                if self.ladder2:
                    corr = torch.where(young, self.lognormal(qf, k, km2, scaling), corr)
                if self.ladder3:
                    corr = torch.where(young3, self.lognormal(qf, k, km3, scaling), corr)
                s = torch.where(exact, s, s - corr)
            p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)
            vh = vh.float()
            o = (torch.einsum("bhgts,bhsd->bhgtd", p * exact, v.float())
                 + torch.einsum("bhgts,bhsd->bhgtd", p * (mid & ~young), vm.float())
                 + torch.einsum("bhgts,bhsd->bhgtd", p * ~(exact | mid | heavy), vh))  # fmt: skip
            if self.heavy[0]:
                o = o + torch.einsum("bhgts,bhsd->bhgtd", p * heavy, vx.float())
            if self.ladder2:
                o = o + torch.einsum("bhgts,bhsd->bhgtd", p * (young & ~young3), vm2.float())
            if self.ladder3:
                o = o + torch.einsum("bhgts,bhsd->bhgtd", p * young3, vm3.float())
        else:
            o = torch.einsum("bhgts,bhsd->bhgtd", p * exact, v.float()) + torch.einsum("bhgts,bhsd->bhgtd",
                                                                                      p * ~exact, vh)  # fmt: skip
        return o.reshape(b, hq, t, d).transpose(1, 2).to(q.dtype), None

    def lognormal(self, qf: torch.Tensor, k: torch.Tensor, kx: torch.Tensor, scaling: float) -> torch.Tensor:
        """``--lognormal-fix``: half the variance of each query's score error against keys coded as ``kx``,
        ``scaling^2 sum_j q_j^2 E[(k_j - kx_j)^2]`` / 2, ``[b, h, g, t, 1]`` (the mean over the prefill's non-sink rows,
        per head and channel): with Gaussian score noise of that variance a coded row's weight ``exp(s + n)`` is
        ``exp(var / 2)`` too large on average against an exact row's; subtracting it removes that bias. 0 when off."""
        if not self.lognormal_fix:
            return torch.zeros(1)
        e = (k.float() - kx.float())[:, :, SINK:PREFILL].pow(2).mean(2)  # [b, h, d]
        return (0.5 * scaling**2 * torch.einsum("bhgtd,bhd->bhgt", qf * qf, e))[..., None]

    def heavy_rows(self, qf: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """``--heavy N:RUNG:SCORE``: per KV head, the ``N`` prompt rows in ``[SINK, SCORE_FROM)`` the exact attention
        of the queries there weighs most (``sum``: H2O's accumulated weight, ``mean``: over the queries that see the
        row), ``[b, h, 1, 1, t]`` (all False when off). What a store could pick at the prefill (its attention reads
        the prompt exactly) and keep refined for good; the scored queries come after them."""
        b, h, _, t, _ = qf.shape
        out = torch.zeros(b, h, 1, 1, t, dtype=torch.bool)
        if not self.heavy[0]:
            return out
        n = SCORE_FROM
        sc = torch.einsum("bhgtd,bhsd->bhgts", qf[:, :, :, SINK:n], k.float()[:, :, :n]) * scaling
        pos = torch.arange(n)
        sc = sc.masked_fill(pos[None, :] > pos[SINK:, None], -math.inf)
        acc = torch.softmax(sc, -1).sum((2, 3))  # [b, h, n]
        if self.heavy[2] == "mean":
            acc = acc / (n - torch.arange(n).clamp_min(SINK)).float()
        acc[..., :SINK] = -math.inf
        top = acc.topk(self.heavy[0], dim=-1).indices
        out[..., :n] = torch.zeros(b, h, n, dtype=torch.bool).scatter(-1, top, True)[:, :, None, None]
        return out

    def _cos_sin(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(k.float(), torch.arange(k.shape[2])[None])
        return cos[:, None].float(), sin[:, None].float()

    def unrope(self, k: torch.Tensor) -> torch.Tensor:
        """Keys ``[1, H, T, D]`` (positions ``0..T-1``) before their rotary embedding."""
        return turn(k.float(), *self._cos_sin(k), back=True)

    def code_keys(self, k: torch.Tensor, bits: Any, embedded: int = 0) -> torch.Tensor:
        """:func:`fake_quantize` of the keys, in the key space of ``--key-space``."""
        if not self.pre_rope:
            return fake_quantize(k, bits, embedded)
        return turn(fake_quantize(self.unrope(k), bits, embedded), *self._cos_sin(k))

    def pre_rope_plan(self, kb: dict[int, list[int | str]]) -> dict[int, list[int | str]]:
        """A config's key widths with every ``tqc`` head re-allocated before RoPE (:func:`pre_rope_widths`)."""
        return {layer: [pre_rope_widths(w, *(s[h] for s in self.pre_stats[layer]))
                        if isinstance(w, str) and w.startswith(CHANNEL_PREFIX) else w for h, w in enumerate(row)]
                for layer, row in kb.items()}  # fmt: skip

    @torch.no_grad()
    def log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model(ids.unsqueeze(0)).logits[0, SCORE_FROM - 1:-1].float(), -1)

    def run(self, kb: Any, vb: Any, r: int, weight: str, vweight: str = "none") -> dict[str, float]:
        self.spec = (kb, vb, r, weight, vweight)
        kls, dps = [], []
        for ids, ref in zip(self.windows, self.refs, strict=True):
            lp = self.log_probs(ids)
            tgt = ids[SCORE_FROM:, None]
            kls.append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
            dps.append(100 * (math.exp(float(ref.gather(1, tgt).mean() - lp.gather(1, tgt).mean())) - 1))
        self.spec = None
        se = lambda xs: float(torch.tensor(xs).std() / math.sqrt(len(xs)))  # noqa: E731
        return {"kl": sum(kls) / len(kls), "kl_se": se(kls), "dppl": sum(dps) / len(dps), "dppl_se": se(dps),
                "kls": kls}


def plan_bits(path: str) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per layer, the K and V codebook widths of each KV head that config ``path`` assigns (0: full precision;
    a ``tqc-<widths>`` head keeps its name)."""
    plan = KVQuantConfig.load(path).resolve(ModelShape(num_layers=30, num_kv_heads=3, head_dim=64))
    width = lambda p: (p if p.startswith(CHANNEL_PREFIX) else CODEBOOK.get(p)  # noqa: E731
                       or (f"v{VECTOR[p]}" if p in VECTOR else f"t{TRELLIS[p]}" if p in TRELLIS else 0))
    return ({i: [width(p.key) for p in row] for i, row in enumerate(plan)},
            {i: [width(p.value) for p in row] for i, row in enumerate(plan)})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="K_BITS:V_BITS:R, e.g. 4:3:32 (tq4 keys, tq3 values, R exact tokens)")
    ap.add_argument("--key-weight", default="none", help="comma list of none, query (see the module doc)")
    ap.add_argument("--value-weight", default="none",
                    help="comma list of none, calib, calib-diag: a value map from the calibration values' covariance "
                    "and the output projection's metric (see output_metric)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--first-window", type=int, default=0,
                    help="skip this many windows first (e.g. 16: windows 17-20, text the recipe's runs never scored)")
    ap.add_argument("--model", default="smollm2-135m", help="the model (stress variants too: smollm2-135m+kbias)")
    ap.add_argument("--key-trend", choices=("none", "linear"), default="none",
                    help="linear: remove a per-channel linear trend over positions (fitted on the prefill) from the "
                    "keys before coding, and add it back (what a RoPE-turned key offset needs)")
    ap.add_argument("--calib-windows", type=int, default=4,
                    help="windows from the END of the corpus that --key-weight calib fits its maps on (and "
                    "--key-space pre-rope its tqc widths)")
    ap.add_argument("--key-space", choices=("post-rope", "pre-rope"), default="post-rope",
                    help="pre-rope: code each key before its rotary embedding and turn it back after decoding (a "
                    "config's tqc widths re-allocated there); the store holds post-RoPE keys")
    ap.add_argument("--mid", default="0:0",
                    help="N:W, an age ladder: the N tokens just older than the exact window at width W (e.g. 51:4), "
                    "the rest at the spec's widths; W = e: the spec's own codes plus their embedded refinement bit "
                    "(what an aged row loses: the store's `ladder`)")
    ap.add_argument("--ladder2", type=int, default=0,
                    help="with --mid N:e, the youngest this many of those N rows keep a second refinement bit (a "
                    "two-rung ladder; a lab proxy, see second_refinement; such a row holds 8 more bytes per K or V)")
    ap.add_argument("--store-rung2", action="store_true",
                    help="--ladder2's bit as the store codes it (ladder2_tokens: refine2 / decode_refined2 in each "
                    "head's space, step from the refined cell), not the lab proxy")
    ap.add_argument("--ladder3", type=int, default=0,
                    help="the youngest this many of the --ladder2 rows keep a third bit (lab proxy on the second)")
    ap.add_argument("--heavy", default="0:1:sum",
                    help="N:RUNG:SCORE (with --mid N:e): besides the age ladder, the N prompt rows per KV head the "
                    "exact attention of the queries before the scored ones weighs most keep RUNG refinement bits "
                    "(1, or 2 with --ladder2 --store-rung2); SCORE: sum (H2O) or mean over the queries that see the "
                    "row (Lab.heavy_rows). A lab probe of importance- instead of age-refined rows; N x 9 (x 17) B "
                    "per K or V row")
    ap.add_argument("--score-scale", type=float, default=1.0,
                    help="multiply every quantized row's attention score by this (exact rows unchanged): a probe of "
                    "whether coding noise flattens attention (default 1: off)")
    ap.add_argument("--lognormal-fix", action="store_true",
                    help="subtract half the expected score-error variance from every coded row's score (Lab.lognormal)")
    ap.add_argument("--layers", default=None, help="quantize only these layers, e.g. 0-14 or 3,5 (default all)")
    ap.add_argument("--gain", default="unbiased",
                    help="comma list of the codebooks' row gains to try: unbiased (default), mse (kvquant.quantizers."
                    "codebook.row_gain; runs recorded before 2026-12-02 used mse)")
    ap.add_argument("--search", choices=("on", "off"), default="on",
                    help="tqc keys' row-scale search (kvquant.quantizers.codebook.ChannelCodebook; on: the default "
                    "since 2026-12-02 06:00 UTC, off: what lab runs before it used)")
    args = ap.parse_args(argv)
    GAIN["search"] = args.search == "on"
    torch.set_num_threads(1)
    layers = None
    if args.layers:
        layers = set()
        for part in args.layers.split(","):
            lo, _, hi = part.partition("-")
            layers.update(range(int(lo), int(hi or lo) + 1))
    need_calib = any(w.startswith("calib") for w in (args.key_weight + "," + args.value_weight).split(","))
    need_calib = need_calib or args.key_space == "pre-rope"
    lab = Lab(args.windows, args.calib_windows if need_calib else 0, layers, args.model, args.first_window,
              pre_rope=args.key_space == "pre-rope")
    lab.trend = args.key_trend == "linear"
    n_, w_ = args.mid.split(":")
    lab.mid = (int(n_), _width(w_))
    if args.ladder2 and (lab.mid[1] != "e" or args.ladder2 > lab.mid[0]):
        raise SystemExit(f"--ladder2 {args.ladder2}: needs --mid N:e with N >= {args.ladder2}")
    lab.ladder2 = args.ladder2
    if args.ladder3 > args.ladder2:
        raise SystemExit(f"--ladder3 {args.ladder3}: needs --ladder2 N with N >= {args.ladder3}")
    lab.ladder3, lab.store_rung2, lab.score_scale = args.ladder3, args.store_rung2, args.score_scale
    lab.lognormal_fix = args.lognormal_fix
    hn, hr, hs = args.heavy.split(":")
    lab.heavy = (int(hn), int(hr), hs)
    if lab.heavy[0] and (lab.mid[1] != "e" or hs not in ("sum", "mean") or hr not in "12"
                         or (hr == "2" and not (args.ladder2 and args.store_rung2))):  # fmt: skip
        raise SystemExit(f"--heavy {args.heavy}: needs --mid N:e, RUNG 1 (or 2 with --ladder2 --store-rung2), "
                         "SCORE sum or mean")
    print("| K | V | R (exact newest) | key map | value map | gain | KL | Δppl % |")
    print("|---|---|---:|---|---|---|---:|---:|")
    for spec in args.specs:
        if ".y" in spec:  # a kvquant config with per-(layer, head) codebook widths: PATH:R
            path, _, r_ = spec.rpartition(":")
            kb, vb, r = *plan_bits(path), int(r_)
            if lab.pre_rope:
                kb = lab.pre_rope_plan(kb)
        else:
            k_, v_, r_ = spec.split(":")
            kb, vb, r = _width(k_), _width(v_), int(r_)
        for weight, vweight, gain in itertools.product(*(a.split(",") for a in (args.key_weight, args.value_weight,
                                                                                args.gain))):  # fmt: skip
            GAIN["gain"] = gain
            t0 = time.perf_counter()
            m = lab.run(kb, vb, r, weight, vweight)
            kn, vn = (spec if isinstance(b, dict) else f"tq{b}" if b else "exact" for b in (kb, vb))
            print(f"| {kn} | {vn} | {r} | {weight} | {vweight} | {gain} | {m['kl']:.4f} ± {m['kl_se']:.4f} | "
                  f"{m['dppl']:+.2f} ± {m['dppl_se']:.2f} |  <!-- {time.perf_counter() - t0:.0f}s; per-window KL "
                  f"{' '.join(f'{x:.4f}' for x in m['kls'])} -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
