import math

import pytest
import torch

from gem_trainer.evaluation import auc, binary_metrics, calibration, normalized_entropy, ranking_metrics, target_ranks


def pairwise_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_definition_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (200,), generator=g).float()  # many ties
    labels = (torch.rand(200, generator=g) < 0.3).float()
    assert math.isclose(auc(scores, labels), pairwise_auc(scores.tolist(), labels.tolist()), rel_tol=1e-12)
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert math.isnan(auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])))


def test_ne_is_one_for_the_base_rate_and_lower_for_better_predictions():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert math.isclose(normalized_entropy(torch.logit(torch.full((4,), 0.25)), labels), 1.0, rel_tol=1e-9)
    assert normalized_entropy(torch.logit(torch.tensor([0.9, 0.1, 0.1, 0.1])), labels) < 0.5
    assert calibration(torch.full((4,), 0.25), labels) == 1.0


def test_binary_metrics_per_task_and_surface():
    probs = torch.tensor([[0.9, 0.4], [0.1, 0.3], [0.8, 0.6], [0.3, 0.1]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    surface = torch.tensor([0, 0, 1, 1])
    result = binary_metrics(torch.logit(probs), labels, surface, ("click", "conversion"), 2)
    assert result["click/all/auc"] == 1.0
    assert result["click/surface_1/count"] == 2.0
    assert result["conversion/all/auc"] == 0.75
    assert math.isclose(result["click/all/calibration"], 2.1 / 2, rel_tol=1e-6)


def test_confident_logits_keep_their_order_and_their_loss():
    """Metrics take logits: as float32 probabilities every logit past ~16.6 was 1.0 (AUC 0.5 here, not 1.0), and a
    confident wrong prediction lost its cross-entropy."""
    logits = torch.tensor([[17.0], [30.0], [20.0], [25.0]])
    labels = torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    result = binary_metrics(logits, labels, torch.zeros(4, dtype=torch.long), ("click",), 1)
    assert result["click/all/auc"] == 1.0
    # two confident mistakes cost their full cross-entropy (17 and 20 nats: a clamped probability capped them at ~16)
    exact = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()).item() / math.log(2)
    assert result["click/all/ne"] == pytest.approx(exact, rel=1e-12) and exact > 9


def test_ranking_metrics_on_a_hand_made_example():
    # three users, target is candidate 0; its ranks are 0, 2 and 5 (ties count against the target)
    scores = torch.tensor(
        [
            [0.9, 0.1, 0.2, 0.3, 0.0, 0.5],
            [0.5, 0.9, 0.6, 0.1, 0.2, 0.3],
            [0.1, 0.9, 0.8, 0.7, 0.6, 0.1],
        ]
    )
    ranks = target_ranks(scores, torch.zeros(3, dtype=torch.int64))
    assert ranks.tolist() == [0, 2, 5]
    m = ranking_metrics(ranks, ks=(1, 5))
    assert m["hr@1"] == 1 / 3 and m["hr@5"] == 2 / 3
    assert math.isclose(m["ndcg@5"], (1.0 + 1.0 / math.log2(4)) / 3)
    assert math.isclose(m["mrr"], (1.0 + 1 / 3 + 1 / 6) / 3)
    # constant scores never flatter: the target ranks last
    assert target_ranks(torch.zeros(1, 6), torch.zeros(1, dtype=torch.int64)).tolist() == [5]


def test_nan_scores_never_flatter_a_model():
    nan = float("nan")
    # a diverged model: every score NaN ranks each target last, not first
    ranks = target_ranks(torch.full((3, 100), nan), torch.tensor([0, 5, 99]))
    assert ranks.tolist() == [99, 99, 99] and ranking_metrics(ranks, (10,))["hr@10"] == 0.0
    # NaN candidates rank ahead of a finite target, as ties do
    scores = torch.tensor([[-3.0, nan, nan, 1.0, -5.0]])
    assert target_ranks(scores, torch.tensor([0])).tolist() == [3]
    assert math.isnan(auc(torch.tensor([nan, 0.2, 0.3, 0.1]), torch.tensor([1.0, 0.0, 1.0, 0.0])))


def test_ne_of_a_group_with_one_class_is_nan_like_its_auc_and_calibration():
    assert math.isnan(normalized_entropy(torch.logit(torch.full((50,), 0.02)), torch.zeros(50)))
    assert math.isnan(normalized_entropy(torch.logit(torch.full((50,), 0.9)), torch.ones(50)))
    g = torch.Generator().manual_seed(0)
    probs, labels = torch.rand(100, 1, generator=g), (torch.rand(100, 1, generator=g) < 0.3).float()
    surface = torch.zeros(100, dtype=torch.long)
    surface[:10], labels[:10] = 1, 0.0  # surface 1: no positive
    metrics = binary_metrics(torch.logit(probs), labels, surface, ("click",), 2)
    assert all(math.isnan(metrics[f"click/surface_1/{m}"]) for m in ("ne", "auc", "calibration"))
    assert math.isfinite(metrics["click/all/ne"])
