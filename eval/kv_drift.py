"""KV-cache drift as an ``evaluate`` metric: ``evaluate.load(kvquant.eval.metrics.EVALUATE_MODULE)``.

``predictions`` are the quantized run's next-token logits (one list of vocab floats per position),
``references`` the reference (FP16) run's logits at the same positions, and ``labels`` the actual next tokens.
Returns KL(reference || quantized) mean and p99, top-1 agreement, mean |delta p| of the correct token, both
perplexities and their difference: the numbers ``kvquant eval`` reports (see :mod:`kvquant.eval.metrics`).

Example::

    import evaluate
    from kvquant.eval.metrics import EVALUATE_MODULE
    drift = evaluate.load(EVALUATE_MODULE)
    drift.compute(predictions=q_logits.tolist(), references=ref_logits.tolist(), labels=targets.tolist())
"""

from __future__ import annotations

import datasets
import evaluate
import torch

_DESCRIPTION = "KL(reference || quantized), top-1 agreement, |delta p| and perplexity of next-token logits."
_KWARGS = """
Args:
    predictions: quantized logits, one list of vocabulary floats per position.
    references: reference logits at the same positions.
    labels: the actual next token at each position (needed for ppl and |delta p|).
Returns:
    kl_mean, kl_p99, kl_max, top1, mean_abs_dp, ppl, ppl_ref, delta_ppl, n_tokens
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class KvDrift(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float32")),
                    "references": datasets.Sequence(datasets.Value("float32")),
                }
            ),
        )

    def _compute(self, predictions, references, labels=None):
        from kvquant.eval.metrics import summarize

        q = torch.tensor(predictions, dtype=torch.float32)
        p = torch.tensor(references, dtype=torch.float32)
        t = torch.tensor(labels if labels is not None else p.argmax(-1).tolist(), dtype=torch.long)
        return summarize(p, q, t)
