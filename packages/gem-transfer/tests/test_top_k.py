"""Distillation from a retrieval teacher's top-k: the cut itself, its store, and the student's auxiliary scores of
each query's own candidates (the next item and the teacher's k best others)."""

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from gem_kunlun import ModelOutput, NextItemTargets, retrieval_logits, scored_item_ids
from gem_kunlun.testing import random_batch
from gem_transfer import (
    DistilledStudent,
    SoftLabelError,
    SoftLabelStore,
    SoftLabelWriter,
    TopKLogits,
    example_fingerprints,
    listwise_soft_label_loss,
    top_k_logits,
)

NUM_ITEMS, DIM = 50, 8


def slow_top_k(scores: torch.Tensor, positives: torch.Tensor, k: int) -> tuple[list, list]:
    """One query at a time, by sorting: the k best items other than the positive, and the logits."""
    items, logits = [], []
    for row, positive in zip(scores.tolist(), positives.tolist()):
        ranked = sorted((i for i in range(len(row)) if i != positive), key=lambda i: -row[i])[:k]
        items.append(ranked)
        logits.append([row[positive]] + [row[i] for i in ranked])
    return items, logits


def test_top_k_keeps_the_next_item_first_and_the_k_best_others_after_it():
    g = torch.Generator().manual_seed(0)
    scores, positives = torch.randn(12, NUM_ITEMS, generator=g), torch.randint(NUM_ITEMS, (12,), generator=g)
    scores[3, positives[3]] = 10.0  # the teacher's best item is the next one: it is not also a rival
    best = top_k_logits(scores, positives, 5)
    items, logits = slow_top_k(scores, positives, 5)
    assert best.items.tolist() == items and best.top_k == 5
    torch.testing.assert_close(best.logits, torch.tensor(logits))
    for k in (0, NUM_ITEMS):
        with pytest.raises(ValueError, match=rf"k must lie in \[1, {NUM_ITEMS - 1}\].*got {k}"):
            top_k_logits(scores, positives, k)
    with pytest.raises(ValueError, match=r"logits \(3, 4\) \[Q, 1 \+ k\]"):
        TopKLogits(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 4))


def test_a_top_k_store_returns_each_querys_items_and_logits_in_any_row_order(tmp_path):
    data = [random_batch(16, seed=step) for step in range(3)]
    queries = [torch.randint(1, 4, (16,), generator=torch.Generator().manual_seed(step)) for step in range(3)]
    tops = []
    writer = SoftLabelWriter(tmp_path / "labels", {"teacher": {"run_dir": "t"}}, steps_per_part=2)
    for step, (batch, q) in enumerate(zip(data, queries)):
        g = torch.Generator().manual_seed(10 + step)
        tops.append(top_k_logits(torch.randn(int(q.sum()), NUM_ITEMS, generator=g), torch.randint(NUM_ITEMS, (int(q.sum()),), generator=g), 4))
        writer.append(step, example_fingerprints(batch), tops[-1], q)
    with pytest.raises(ValueError, match="one kind of row"):
        writer.append(3, example_fingerprints(data[0]), tops[0].logits, queries[0])
    folder = writer.close()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["top_k"] == 4 and meta["width"] == 5 and meta["format"] == 3 and meta["log_weights"] is None
    store = SoftLabelStore(folder)
    for step in (2, 0, 1):
        rows = torch.randperm(16, generator=torch.Generator().manual_seed(step))[:7]
        first = torch.cumsum(queries[step], 0) - queries[step]
        wanted = torch.cat([torch.arange(first[r], first[r] + queries[step][r]) for r in rows.tolist()])
        found = store.lookup(step, example_fingerprints(data[step])[rows])
        assert isinstance(found, TopKLogits)
        assert torch.equal(found.items, tops[step].items[wanted]) and torch.equal(found.logits, tops[step].logits[wanted])
    # a part whose items column is gone is a damaged store, named
    import pyarrow.parquet as pq

    part = folder / meta["parts"][0]["file"]
    pq.write_table(pq.read_table(part).drop_columns(["items"]), part)
    with pytest.raises(SoftLabelError, match=r"part-00000.parquet: unreadable soft-label part"):
        SoftLabelStore(folder).lookup(0, example_fingerprints(data[0]))


def test_a_tail_draws_other_items_uniformly_and_weights_them_by_what_they_stand_for():
    g = torch.Generator().manual_seed(1)
    scores, positives = torch.randn(64, NUM_ITEMS, generator=g), torch.randint(NUM_ITEMS, (64,), generator=g)
    k, m, pool = 5, 8, NUM_ITEMS - 1 - 5
    plain, tailed = top_k_logits(scores, positives, k), top_k_logits(scores, positives, k, m, torch.Generator().manual_seed(2))
    assert torch.equal(tailed.items[:, :k], plain.items) and torch.equal(tailed.logits[:, : 1 + k], plain.logits)
    drawn = tailed.items[:, k:]
    for row in range(64):  # m distinct items, none of them the next item or one of the top k
        assert len(set(drawn[row].tolist())) == m
        assert not set(drawn[row].tolist()) & (set(plain.items[row].tolist()) | {int(positives[row])})
    torch.testing.assert_close(tailed.logits[:, 1 + k:], scores.gather(1, drawn))
    torch.testing.assert_close(tailed.log_weights, torch.tensor([0.0] * (1 + k) + [math.log(pool / m)] * m))
    # uniform: over many draws every item of the rest is drawn about equally often
    counts = torch.zeros(NUM_ITEMS)
    for seed in range(200):
        counts += torch.bincount(top_k_logits(scores[:1], positives[:1], k, m, torch.Generator().manual_seed(seed)).items[0, k:],
                                 minlength=NUM_ITEMS)
    rest = counts[counts > 0]
    assert rest.numel() == pool and (rest - 200 * m / pool).abs().max() < 5 * (200 * m / pool) ** 0.5
    with pytest.raises(ValueError, match=rf"the tail must lie in \[1, {pool}\]"):
        top_k_logits(scores, positives, k, pool + 1)


def test_a_whole_tail_makes_the_weighted_losses_those_of_the_whole_catalogue():
    """With every other item in the tail (each standing for itself) the stored columns are the catalogue: the
    distillation loss and the adapter's fit equal those over every item; with a sampled tail they estimate them."""
    from gem_transfer.distillation import ListwiseAdapter

    g = torch.Generator().manual_seed(3)
    teacher, student = 3 * torch.randn(32, NUM_ITEMS, generator=g), torch.randn(32, NUM_ITEMS, generator=g)
    positives = torch.randint(NUM_ITEMS, (32,), generator=g)
    whole = top_k_logits(teacher, positives, 4, NUM_ITEMS - 5, torch.Generator().manual_seed(0))
    columns = torch.cat([positives[:, None], whole.items], 1)  # every item once per row, the next one first
    assert torch.equal(columns.sort(1).values, torch.arange(NUM_ITEMS).expand(32, -1))
    reference = listwise_soft_label_loss(student.gather(1, columns), teacher.gather(1, columns), 2.0)
    torch.testing.assert_close(listwise_soft_label_loss(student.gather(1, columns), whole.logits, 2.0, whole.log_weights), reference)
    adapter = ListwiseAdapter()
    torch.testing.assert_close(adapter.fit_loss(whole.logits, whole.log_weights), adapter.fit_loss(teacher.gather(1, columns)))
    # a sampled tail: the adapter's fit is close to the whole catalogue's, where the top k alone is far off (too flat)
    sampled = top_k_logits(teacher, positives, 4, 15, torch.Generator().manual_seed(1))
    full = adapter.fit_loss(teacher.gather(1, columns))
    estimate = torch.stack([adapter.fit_loss(t.logits, t.log_weights) for t in
                            (top_k_logits(teacher, positives, 4, 15, torch.Generator().manual_seed(s)) for s in range(20))]).mean()
    top_only = adapter.fit_loss(top_k_logits(teacher, positives, 4).logits)
    assert abs(estimate - full) < 0.25 * abs(top_only - full) and sampled.top_k == 19


def test_a_store_keeps_the_tail_and_its_weights(tmp_path):
    batch = random_batch(16, seed=0)
    g = torch.Generator().manual_seed(4)
    tailed = top_k_logits(torch.randn(16, NUM_ITEMS, generator=g), torch.randint(NUM_ITEMS, (16,), generator=g), 4, 6, g)
    writer = SoftLabelWriter(tmp_path / "labels", {"teacher": {"run_dir": "t"}})
    writer.append(0, example_fingerprints(batch), tailed)
    with pytest.raises(ValueError, match="another tail"):
        writer.append(1, example_fingerprints(batch), top_k_logits(torch.randn(16, NUM_ITEMS), torch.randint(NUM_ITEMS, (16,)), 10))
    store = SoftLabelStore(writer.close())
    found = store.lookup(0, example_fingerprints(batch))
    assert torch.equal(found.items, tailed.items) and torch.equal(found.logits, tailed.logits)
    torch.testing.assert_close(found.log_weights, tailed.log_weights)


class TinyRetriever(nn.Module):
    """A retrieval student with the interface distillation reads: queries from the dense features, an item table."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(random_batch(1).dense.shape[1], DIM)
        self.items = nn.Embedding(NUM_ITEMS, DIM)
        self.representation_dim = DIM

    def forward(self, batch) -> ModelOutput:
        targets = batch.next_items
        query, vectors = self.query(batch.dense), self.items(scored_item_ids(targets, NUM_ITEMS))
        return ModelOutput(logits=retrieval_logits(query, vectors, targets), aux_loss=query.new_zeros(()),
                           representation=query, item_vectors=vectors)


def retrieval_batch(seed: int, negatives: int | None):
    batch = random_batch(16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    positives = torch.randint(NUM_ITEMS, (16,), generator=g)
    sampled = None if negatives is None else torch.randint(NUM_ITEMS, (16, negatives), generator=g)
    return dataclasses.replace(batch, next_items=NextItemTargets(False, positives, sampled, "softmax"))


@pytest.mark.parametrize("negatives", [3, None], ids=["sampled", "catalogue"])
def test_the_auxiliary_head_scores_the_teachers_top_k_and_the_serving_scores_are_unchanged(negatives):
    torch.manual_seed(0)
    student = DistilledStudent(TinyRetriever(), DIM, 1, 1, adapter=True, retrieval=True)
    batch = retrieval_batch(0, negatives)
    teacher = top_k_logits(torch.randn(16, NUM_ITEMS), batch.next_items.positives, 6)
    plain, distilled = student(batch), student(batch, teacher)
    torch.testing.assert_close(distilled.logits, plain.logits)  # the batch's own candidates, the same scores
    assert distilled.item_vectors.shape == plain.item_vectors.shape
    candidates = torch.cat([batch.next_items.positives[:, None], teacher.items], 1)
    core = student.student
    expected = torch.einsum("nd,nkd->nk", student.auxiliary_head(core.query(batch.dense)), core.items(candidates))
    torch.testing.assert_close(distilled.auxiliary_logits, expected)
    # the listwise loss against the (identity at the start) adapter's teacher, plus the adapter's fit of column 0
    fit = torch.nn.functional.cross_entropy(teacher.logits, torch.zeros(16, dtype=torch.long))
    torch.testing.assert_close(distilled.distillation_loss, listwise_soft_label_loss(expected, teacher.logits) + fit)
    with pytest.raises(ValueError, match="holds 5 queries, the batch 16"):
        student(batch, TopKLogits(teacher.items[:5], teacher.logits[:5]))
    with pytest.raises(ValueError, match="distils retrieval students"):
        DistilledStudent(TinyRetriever(), DIM, 1, 1)(batch, teacher)


def test_training_on_the_top_k_brings_the_students_ranking_towards_the_teachers():
    torch.manual_seed(0)
    teacher_items = torch.randn(NUM_ITEMS, DIM)
    student = DistilledStudent(TinyRetriever(), DIM, 1, 1, adapter=False, retrieval=True)
    batches = [retrieval_batch(seed, 3) for seed in range(4)]
    tops = [top_k_logits(b.dense[:, :1].expand(-1, NUM_ITEMS) * teacher_items[:, 0] * 3, b.next_items.positives, 8)
            for b in batches]
    gap = lambda: sum(student(b, t).distillation_loss.item() for b, t in zip(batches, tops))
    before = gap()
    optimizer = torch.optim.Adam(student.parameters(), lr=2e-2)
    for _ in range(80):
        for b, t in zip(batches, tops):
            optimizer.zero_grad()
            student(b, t).aux_loss.backward()
            optimizer.step()
    assert gap() < 0.5 * before


def test_a_distilled_student_ranks_through_its_students_per_user_path_when_it_has_one():
    from gem_kunlun import CandidateInput, CandidateScorer

    class Scorer(TinyRetriever):
        candidate_input = CandidateInput.IDS

        def score_candidates(self, requests, candidates):
            return torch.einsum("ud,ucd->uc", self.query(requests.dense), self.items(candidates))

    assert not isinstance(DistilledStudent(TinyRetriever(), DIM, 1, 1, retrieval=True), CandidateScorer)
    student = DistilledStudent(Scorer(), DIM, 1, 1, retrieval=True)
    assert isinstance(student, CandidateScorer) and student.candidate_input is CandidateInput.IDS
    requests, candidates = random_batch(4, seed=1), torch.randint(NUM_ITEMS, (4, 7))
    torch.testing.assert_close(student.score_candidates(requests, candidates), student.student.score_candidates(requests, candidates))
