"""Fast teacher-forced lab for codebook KV configs (issue 14): which knob buys quality, before an exact-decode run.

    python benchmarks/codebook_lab.py tq4:tq4:1 tq4:tq4:16 tq4:tq3:32 --key-weight none,query --windows 4

One forward per window replaces ~64 one-token decode steps: every attention layer of SmolLM2-135M
(fp32, WikiText-2 test, windows of 1024 tokens) is replaced by an attention in which query ``t``
sees the *decode-equivalent* history: keys/values ``j <= t - R`` (not the 4 sink tokens) as
stored by the codebook quantizer (:class:`~kvquant.quantizers.Codebook`, its static state fitted
on the first 960 tokens, like the recipe's prefill), the newest ``R`` ones (itself included) exact,
like an ``R``-token residual window. Positions 512..1023 are scored against the unquantized model:
KL(reference || config) and Δppl %, with one standard error over windows. Its numbers are *not* the
acceptance protocol (exact decode, ``recipes/lowbit-smollm2.yaml``); they rank configs (they read
~1.5x higher KL than exact decode scored on the last 64 tokens).

``--key-weight query`` also tries a query-aware linear map of each key head before the codebook,
``k' = A (k - mu)``, ``q' = A^-T q`` (scores exact): ``A^T A = Ck^-1 # Cq`` (matrix geometric mean of the
inverse key covariance and the query second moment of that head's query group), the map that
minimises the expected score error of an isotropic quantization error. It is an oracle here (fitted
on the scored window itself): it tells what such a calibrated map could buy, nothing is stored.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvquant.eval.data import load_text, tokenize
from kvquant.eval.models import load_model
from kvquant.quantizers import Codebook

WINDOW, PREFILL, SINK, SCORE_FROM = 1024, 960, 4, 512


def _psd_power(c: torch.Tensor, p: float) -> torch.Tensor:
    e, u = torch.linalg.eigh(c)
    return (u * e.clamp_min(1e-9 * e.max()) ** p) @ u.T


def query_weight(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head ``(A, A^-1)`` ``[H, D, D]`` from the window's queries and keys (see the module doc)."""
    _, hq, _, d = q.shape
    h = k.shape[1]
    eye = torch.eye(d, dtype=torch.float64)
    out, inv = [], []
    for i in range(h):
        kk = k[0, i, SINK:PREFILL].double()
        kk = kk - kk.mean(0)
        ck = kk.T @ kk / len(kk) + 1e-6 * eye
        qq = q[0, i * hq // h:(i + 1) * hq // h, SINK:PREFILL].double().reshape(-1, d)
        cq = qq.T @ qq / len(qq) + 1e-6 * eye
        ki = torch.linalg.inv(ck)
        a, ai = _psd_power(ki, 0.5), _psd_power(ki, -0.5)
        m = a @ _psd_power(ai @ cq @ ai, 0.5) @ a  # Ck^-1 # Cq
        root = _psd_power(m, 0.5)
        out.append(root.float())
        inv.append(torch.linalg.inv(root).float())
    return torch.stack(out), torch.stack(inv)


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x[1, H, T, D]`` through a codebook quantizer fitted on the prefill's non-sink tokens."""
    qz = Codebook(x.shape[-1], bits)
    state = qz.fit(x[:, :, SINK:PREFILL].float())
    return qz.dequantize(qz.quantize(x.float(), state), state, torch.float32)


class Lab:
    """The model with its attention replaced by the decode-equivalent quantized attention."""

    def __init__(self, windows: int) -> None:
        lm = load_model("smollm2-135m", dtype="float32", progress=False)
        self.model = lm.model
        ids = tokenize(load_text("wikitext-2").text, lm.tokenizer)
        self.windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(windows)]
        self.spec: tuple[int, int, int, str] | None = None
        self.sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self.attention
        self.refs = [self.log_probs(w) for w in self.windows]

    def attention(self, module, q, k, v, mask, scaling=None, **kw):  # noqa: ANN001 (transformers' signature)
        if self.spec is None:
            return self.sdpa(module, q, k, v, mask, scaling=scaling, **kw)
        kb, vb, r, weight = self.spec
        b, hq, t, d = q.shape
        h = k.shape[1]
        if weight == "query":
            a, ai = query_weight(q, k)
            mu = k[:, :, SINK:PREFILL].mean(2, keepdim=True)
            kw_ = torch.einsum("bhtd,hed->bhte", k.float() - mu, a)
            kh = torch.einsum("bhte,hde->bhtd", fake_quantize(kw_, kb), ai) + mu
        else:
            kh = fake_quantize(k, kb)
        vh = fake_quantize(v, vb)
        pos = torch.arange(t)
        causal = pos[None, :] <= pos[:, None]
        exact = (pos[None, :] > pos[:, None] - r) | (pos[None, :] < SINK)
        qf = q.float().view(b, h, hq // h, t, d)
        s = torch.where(exact, torch.einsum("bhgtd,bhsd->bhgts", qf, k.float()),
                        torch.einsum("bhgtd,bhsd->bhgts", qf, kh)) * scaling  # fmt: skip
        p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)
        o = torch.einsum("bhgts,bhsd->bhgtd", p * exact, v.float()) + torch.einsum("bhgts,bhsd->bhgtd",
                                                                                  p * ~exact, vh)  # fmt: skip
        return o.reshape(b, hq, t, d).transpose(1, 2).to(q.dtype), None

    @torch.no_grad()
    def log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model(ids.unsqueeze(0)).logits[0, SCORE_FROM - 1:-1].float(), -1)

    def run(self, kb: int, vb: int, r: int, weight: str) -> dict[str, float]:
        self.spec = (kb, vb, r, weight)
        kls, dps = [], []
        for ids, ref in zip(self.windows, self.refs, strict=True):
            lp = self.log_probs(ids)
            tgt = ids[SCORE_FROM:, None]
            kls.append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
            dps.append(100 * (math.exp(float(ref.gather(1, tgt).mean() - lp.gather(1, tgt).mean())) - 1))
        self.spec = None
        se = lambda xs: float(torch.tensor(xs).std() / math.sqrt(len(xs)))  # noqa: E731
        return {"kl": sum(kls) / len(kls), "kl_se": se(kls), "dppl": sum(dps) / len(dps), "dppl_se": se(dps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="K_BITS:V_BITS:R, e.g. 4:3:32 (tq4 keys, tq3 values, R exact tokens)")
    ap.add_argument("--key-weight", default="none", help="comma list of none, query (see the module doc)")
    ap.add_argument("--windows", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lab = Lab(args.windows)
    print("| K | V | R (exact newest) | key map | KL | Δppl % |\n|---|---|---:|---|---:|---:|")
    for spec in args.specs:
        kb, vb, r = (int(x) for x in spec.replace("tq", "").split(":"))
        for weight in args.key_weight.split(","):
            t0 = time.perf_counter()
            m = lab.run(kb, vb, r, weight)
            print(f"| tq{kb} | tq{vb} | {r} | {weight} | {m['kl']:.4f} ± {m['kl_se']:.4f} | "
                  f"{m['dppl']:+.2f} ± {m['dppl_se']:.2f} |  <!-- {time.perf_counter() - t0:.0f}s -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
