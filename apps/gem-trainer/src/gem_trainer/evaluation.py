"""Evaluation metrics: NE, AUC and calibration for binary tasks; HR@K, NDCG@K and MRR for ranked candidate lists."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Cross-entropy of the predictions (``logits``) divided by the entropy of always predicting the base rate (lower
    is better; 1.0 means no better than the base rate); NaN if one class is absent (the base rate's entropy is then
    zero: no prediction can be compared with it, as AUC and calibration say NaN there).

    NOTE: from the logits in float64: every example costs its full cross-entropy (a probability clamped away from 0
    and 1 capped a confident mistake at -log(eps), ~16 nats where a logit of 30 costs 30)."""
    y = labels.double()
    positives = float(y.sum())
    if positives == 0 or positives == y.numel():
        return float("nan")
    cross_entropy = F.binary_cross_entropy_with_logits(logits.double(), y)
    rate = float(y.mean().clamp(eps, 1 - eps))
    base = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return float(cross_entropy) / base


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum formula, ties given their average rank; NaN if one class is absent
    or a score is NaN (sorting would place NaN above every number: a diverged model would look perfect)."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0 or bool(scores.isnan().any()):
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2
    ranks[order] = average[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def calibration(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Predicted over observed positives (1.0 is perfectly calibrated on average)."""
    observed = float(labels.double().sum())
    return float(probs.double().sum()) / observed if observed else float("nan")


def binary_metrics(
    logits: torch.Tensor, labels: torch.Tensor, surface: torch.Tensor, tasks: tuple[str, ...], num_surfaces: int
) -> dict[str, float]:
    """``{task}/{all|surface_k}/{ne,auc,calibration,count}`` for ``logits, labels [N, num_tasks]``.

    NOTE: AUC ranks the logits, NE takes them through a float64 cross-entropy and calibration reads float64
    probabilities: in float32 every logit past ~16.6 rounds to probability 1.0, and confident examples would tie
    (AUC) or lose their cross-entropy."""
    probs = torch.sigmoid(logits.double())
    result: dict[str, float] = {}
    groups = [("all", torch.ones_like(surface, dtype=torch.bool))]
    groups += [(f"surface_{s}", surface == s) for s in range(num_surfaces)] if num_surfaces > 1 else []
    for t, task in enumerate(tasks):
        for group, mask in groups:
            p, y = probs[mask, t], labels[mask, t]
            prefix = f"{task}/{group}"
            result[f"{prefix}/count"] = float(mask.sum())
            if p.numel() == 0:
                continue
            result[f"{prefix}/ne"] = normalized_entropy(logits[mask, t], y)
            result[f"{prefix}/auc"] = auc(logits[mask, t], y)
            result[f"{prefix}/calibration"] = calibration(p, y)
    return result


def target_ranks(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """0-based rank of each row's target among its candidates, ``scores [N, C]``, ``target [N]`` int64.

    Ties count against the target (a candidate scoring equal to it ranks ahead), so constant scores give
    the worst rank instead of a flattering one; likewise a NaN score: a NaN candidate ranks ahead of the target,
    and a NaN target ranks last (NaN compares false with everything, which would otherwise rank it first).
    """
    target_score = scores.gather(1, target.view(-1, 1))
    ranks = ((scores >= target_score) | scores.isnan()).sum(1) - 1
    return torch.where(target_score.view(-1).isnan(), scores.shape[1] - 1, ranks)


def ranking_metrics(ranks: torch.Tensor, ks: tuple[int, ...]) -> dict[str, float]:
    """HR@K, NDCG@K (one relevant item) and MRR from 0-based target ranks."""
    ranks = ranks.double()
    result = {}
    for k in ks:
        hit = ranks < k
        result[f"hr@{k}"] = float(hit.double().mean())
        result[f"ndcg@{k}"] = float(torch.where(hit, 1.0 / torch.log2(ranks + 2.0), torch.zeros_like(ranks)).mean())
    result["mrr"] = float((1.0 / (ranks + 1.0)).mean())
    return result
