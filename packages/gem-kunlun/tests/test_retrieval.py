"""Retrieval training: every-position SASRec queries, the two-tower Kunlun, the next-item losses."""

import dataclasses

import pytest
import torch
from torch.nn import functional as F
from torchrec import KeyedJaggedTensor

from gem_kunlun import (
    Batch,
    EventType,
    FeatureSpec,
    KunlunConfig,
    KunlunModel,
    NextItemTargets,
    SasrecConfig,
    SasrecModel,
    SparseFeature,
    dot_scores,
    next_item_loss,
    retrieval_logits,
)
from gem_kunlun.testing import random_batch

NUM_ITEMS, NUM_ATTRIBUTES = 30, 7
SPEC = FeatureSpec(
    num_dense=0,
    sparse=(SparseFeature("item_id", NUM_ITEMS), SparseFeature("item_attributes", NUM_ATTRIBUTES), SparseFeature("user_age", 5)),
    events=(EventType("history", (SparseFeature("history_item_id", NUM_ITEMS), SparseFeature("history_attributes_0", NUM_ATTRIBUTES))),),
    tasks=("next_item",),
    candidate=("item_id", "item_attributes"),
)


def catalogue() -> KeyedJaggedTensor:
    """Item i has attributes {i % 7} and, for even i, also {(i + 3) % 7}."""
    items = torch.arange(NUM_ITEMS)
    lengths = 1 + (items % 2 == 0).long()
    attributes = torch.cat([torch.tensor([i % 7] + ([(i + 3) % 7] if i % 2 == 0 else [])) for i in range(NUM_ITEMS)])
    return KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "item_attributes"], values=torch.cat([items, attributes]),
                                               lengths=torch.cat([torch.ones_like(items), lengths]))


def with_candidates(batch: Batch, items: torch.Tensor, user_features: bool = True) -> Batch:
    """``batch`` whose candidate features are those of ``items [B]`` (from the catalogue), user features kept."""
    table = catalogue().to_dict()
    attributes = [table["item_attributes"].values()[table["item_attributes"].offsets()[i] : table["item_attributes"].offsets()[i + 1]]
                  for i in items.tolist()]
    keys = ["item_id", "item_attributes"]
    values = [items, *attributes]
    lengths = [torch.ones_like(items), torch.tensor([a.numel() for a in attributes])]
    if user_features:
        age = batch.sparse["user_age"]
        keys, values, lengths = keys + ["user_age"], values + [age.values()], lengths + [age.lengths()]
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(batch.dense, sparse, batch.sequences, batch.labels, batch.surface)


def test_losses_match_their_definitions_on_random_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g)
    positives = torch.randint(NUM_ITEMS, (6,), generator=g)
    sampled = NextItemTargets(every=False, positives=positives, negatives=torch.randint(NUM_ITEMS, (6, 3), generator=g), loss="binary")
    expected = (-F.logsigmoid(logits[:, 0]) - F.logsigmoid(-logits[:, 1:]).sum(1)).mean()
    torch.testing.assert_close(next_item_loss(logits, sampled), expected)
    sampled_softmax = NextItemTargets(False, positives, sampled.negatives, "softmax")
    torch.testing.assert_close(next_item_loss(logits, sampled_softmax), (torch.logsumexp(logits, 1) - logits[:, 0]).mean())
    full = torch.randn(6, NUM_ITEMS, generator=g)
    catalogue_softmax = NextItemTargets(False, positives, None, "softmax")
    torch.testing.assert_close(next_item_loss(full, catalogue_softmax),
                               (torch.logsumexp(full, 1) - full[torch.arange(6), positives]).mean())


def test_sampled_logits_are_columns_of_the_catalogue_logits():
    g = torch.Generator().manual_seed(1)
    queries, items = torch.randn(5, 8, generator=g), torch.randn(NUM_ITEMS, 8, generator=g)
    targets = NextItemTargets(False, torch.randint(NUM_ITEMS, (5,), generator=g), torch.randint(NUM_ITEMS, (5, 4), generator=g), "binary")
    scored = targets.scored_items()
    full = retrieval_logits(queries, items, NextItemTargets(False, targets.positives, None, "softmax"))
    torch.testing.assert_close(retrieval_logits(queries, items[scored.reshape(-1)], targets), full.gather(1, scored))


def test_scores_stay_float32_under_bf16_autocast():
    """Ranking compares thousands of close scores: under autocast they are computed and returned in float32
    (bf16's 8 significant bits would tie and swap them), equal to the float32 products."""
    g = torch.Generator().manual_seed(2)
    queries, items = torch.randn(6, 32, generator=g) * 4, torch.randn(NUM_ITEMS, 32, generator=g) * 4
    per_query = torch.randn(6, 5, 32, generator=g)
    targets = NextItemTargets(False, torch.randint(NUM_ITEMS, (6,), generator=g), None, "softmax")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = queries @ items.t()  # what autocast makes of a plain product
        catalogue, own = retrieval_logits(queries, items, targets), dot_scores(queries, per_query)
    assert rounded.dtype == torch.bfloat16 and catalogue.dtype == own.dtype == torch.float32
    torch.testing.assert_close(catalogue, queries @ items.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(own, torch.einsum("nd,nkd->nk", queries, per_query), rtol=1e-5, atol=1e-5)
    assert (rounded.float() != catalogue).float().mean() > 0.5  # the bf16 scores are another ranking's input


def test_targets_are_checked():
    with pytest.raises(ValueError, match="binary loss needs sampled negatives"):
        NextItemTargets(False, torch.zeros(3, dtype=torch.int64), None, "binary")
    with pytest.raises(ValueError, match="negatives must be"):
        NextItemTargets(False, torch.zeros(3, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64), "binary")
    with pytest.raises(ValueError, match="candidate names"):
        FeatureSpec(num_dense=0, sparse=(SparseFeature("a", 3),), events=(), tasks=("t",), candidate=("b",))


def test_item_ids_outside_the_catalogue_are_one_line_errors_naming_the_field():
    """A -1 (a padding of ragged candidate lists) indexed the two-tower's last item vector without a word; ids at the
    catalogue's size failed inside the lookups with messages naming no field."""
    ids = torch.tensor([[3, -1]])
    with pytest.raises(ValueError, match=r"^batch\.next_items\.negatives has item ids outside the catalogue: from -1 to 3$"):
        NextItemTargets(False, torch.tensor([1]), ids, "binary")
    with pytest.raises(ValueError, match=r"^batch\.next_items\.positives has item ids outside the catalogue of \[0, 30\)"):
        NextItemTargets(False, torch.tensor([30]), None, "softmax", catalogue=catalogue())
    requests = random_batch(1, seed=3, max_events=6, spec=SPEC)
    with pytest.raises(ValueError, match=r"^candidates has item ids outside the catalogue of \[0, 30\): from -1 to 1$"):
        two_tower().score_candidates(requests, torch.tensor([[1, -1]]), catalogue=catalogue())
    model, spec = sasrec()
    requests = random_batch(1, seed=3, max_events=6, spec=spec)
    with pytest.raises(ValueError, match=r"^candidates has item ids outside the catalogue of \[0, 30\): from 1 to 30$"):
        model.score_candidates(requests, torch.tensor([[1, 30]]))


@pytest.mark.parametrize("layout", ["grouped", "padded"])
def test_sasrec_encodes_a_batch_of_no_examples(layout):
    """A rank's empty share: the length-grouped layout's first group of no rows took the max of no lengths."""
    model, _ = sasrec(layout)
    vectors, lengths = torch.zeros(0, 16), torch.zeros(0, dtype=torch.int64)
    assert model.user_representation(vectors, lengths).shape == (0, 16)
    assert model.position_representations(vectors, lengths).shape == (0, 16)


def sasrec(layout: str = "auto") -> SasrecModel:
    torch.manual_seed(0)
    spec = FeatureSpec(0, SPEC.sparse[:2], (EventType("history", SPEC.events[0].features[:1]),), SPEC.tasks)
    return SasrecModel(spec, SasrecConfig(dim=16, num_heads=2, max_seq_len=8, rows_per_group=3, layout=layout)).eval(), spec


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("every", [False, True])
def test_sasrec_padded_layout_equals_the_grouped_layout_outputs_and_gradients(every, device):
    # the GPU's layout (one group at max_seq_len, no host sync) against the CPU's (length-sorted groups)
    (grouped, spec), (padded, _) = sasrec("grouped"), sasrec("padded")
    padded.load_state_dict(grouped.state_dict())
    grouped, padded = grouped.to(device), padded.to(device)
    g = torch.Generator().manual_seed(11)
    batch = random_batch(10, seed=12, max_events=8 if every else 12, spec=spec)  # empty histories included
    n = int(batch.sequences["history"].lengths().sum()) if every else 10
    batch.next_items = NextItemTargets(every, torch.randint(NUM_ITEMS, (n,), generator=g),
                                       torch.randint(NUM_ITEMS, (n, 2), generator=g), "binary")
    batch = batch.to(torch.device(device))
    outputs = []
    for m in (grouped, padded):
        logits = m(batch).logits
        logits.square().sum().backward()
        outputs.append((logits, {k: p.grad for k, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(outputs[1][0], outputs[0][0])
    assert outputs[1][1].keys() == outputs[0][1].keys() and len(outputs[0][1]) > 5
    for name, grad in outputs[0][1].items():
        torch.testing.assert_close(outputs[1][1][name], grad, msg=name)


def test_sasrec_every_position_queries_are_causal_and_the_last_is_the_user_representation():
    m, spec = sasrec()
    batch = random_batch(7, seed=3, max_events=8, spec=spec)
    history = batch.sequences["history"]
    ids = history.ids["history_item_id"]
    vectors, _ = m._lookup(history.ids, torch.zeros(1, dtype=torch.int64))
    with torch.no_grad():
        every = m.position_representations(vectors, ids.lengths())
        last = m.user_representation(vectors, ids.lengths())
        ends = torch.cumsum(ids.lengths(), 0) - 1
        nonempty = ids.lengths() > 0
        torch.testing.assert_close(every[ends[nonempty]], last[nonempty])
        # changing the newest item of every example leaves the outputs at earlier events unchanged
        changed = vectors.clone()
        changed[ends[nonempty]] = torch.randn(int(nonempty.sum()), 16)
        again = m.position_representations(changed, ids.lengths())
        earlier = torch.ones(vectors.shape[0], dtype=torch.bool)
        earlier[ends[nonempty]] = False
        torch.testing.assert_close(again[earlier], every[earlier])
        assert not torch.allclose(again[~earlier], every[~earlier])


def test_sasrec_retrieval_logits_equal_pointwise_logits_of_the_same_items():
    m, spec = sasrec()
    batch = random_batch(6, seed=4, max_events=8, spec=spec)
    g = torch.Generator().manual_seed(5)
    positives, negatives = torch.randint(NUM_ITEMS, (6,), generator=g), torch.randint(NUM_ITEMS, (6, 2), generator=g)
    batch.next_items = NextItemTargets(False, positives, negatives, "binary")
    with torch.no_grad():
        logits = m(batch).logits
        batch.next_items = None
        for column, items in enumerate([positives, negatives[:, 0], negatives[:, 1]]):
            pointwise = m(with_candidates(batch, items, user_features=False)).logits[:, 0]
            torch.testing.assert_close(logits[:, column], pointwise)
    batch.next_items = NextItemTargets(False, positives, negatives, "binary")
    assert m.flops(batch)["score"] == 2.0 * 16 * 6 * 3  # every query against its positive and 2 negatives


def test_sasrec_every_position_training_rejects_histories_longer_than_the_model_reads():
    m, spec = sasrec()
    batch = random_batch(3, seed=6, max_events=20, spec=spec)
    t = int(batch.sequences["history"].lengths().sum())
    batch.next_items = NextItemTargets(True, torch.zeros(t, dtype=torch.int64), torch.zeros(t, 1, dtype=torch.int64), "binary")
    with pytest.raises(ValueError, match="max_seq_len"):
        m(batch)


SHARED_SPEC = dataclasses.replace(SPEC, shared_ids=(("item_id", "history_item_id"),))


def two_tower(shared: bool = False, score: str = "dot") -> KunlunModel:
    torch.manual_seed(0)
    return KunlunModel(SHARED_SPEC if shared else SPEC,
                       KunlunConfig(max_seq_len=8, block_size=4, window=4, two_tower=True, share_item_table=shared, score=score)).eval()


@pytest.mark.parametrize("shared,score", [(False, "dot"), (True, "dot"), (False, "cosine")],
                         ids=["own_item_table", "shared_item_table", "cosine"])
def test_two_tower_kunlun_scores_the_same_on_every_path(shared, score):
    m = two_tower(shared, score)
    requests = random_batch(5, seed=7, max_events=10, spec=SPEC)
    candidates = torch.randint(NUM_ITEMS, (5, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        fast = m.score_candidates(requests, candidates, catalogue=catalogue())
        for column in range(candidates.shape[1]):
            pointwise = m(with_candidates(requests, candidates[:, column])).logits[:, 0]
            torch.testing.assert_close(fast[:, column], pointwise)
        requests.next_items = NextItemTargets(False, candidates[:, 0], None, "softmax", catalogue=catalogue())
        full = m(requests).logits
        assert full.shape == (5, NUM_ITEMS)
        torch.testing.assert_close(full.gather(1, candidates), fast)
        requests.next_items = NextItemTargets(False, candidates[:, 0], candidates[:, 1:], "binary", catalogue=catalogue())
        torch.testing.assert_close(m(requests).logits, fast)


def test_two_tower_kunlun_request_side_ignores_the_candidate_and_the_item_side_reads_attributes():
    m = two_tower()
    requests = random_batch(4, seed=9, max_events=6, spec=SPEC)
    with torch.no_grad():
        a, _ = m.trunk(*m.encoder(with_candidates(requests, torch.tensor([0, 1, 2, 3]))))
        b, _ = m.trunk(*m.encoder(with_candidates(requests, torch.tensor([9, 8, 7, 6]))))
        torch.testing.assert_close(a, b)
        table = catalogue()
        other = KeyedJaggedTensor.from_lengths_sync(keys=table.keys(), values=torch.cat([table["item_id"].values(), (table["item_attributes"].values() + 1) % 7]),
                                                    lengths=table.lengths())
        assert not torch.allclose(m.item_tower(table), m.item_tower(other))


def test_two_tower_needs_candidate_features_and_crossing_kunlun_rejects_retrieval_batches():
    with pytest.raises(ValueError, match="candidate features"):
        KunlunModel(FeatureSpec(0, SPEC.sparse, SPEC.events, SPEC.tasks), KunlunConfig(two_tower=True))
    crossing = KunlunModel(SPEC, KunlunConfig(max_seq_len=8, block_size=4, window=4))
    batch = random_batch(2, seed=1, spec=SPEC)
    batch.next_items = NextItemTargets(False, torch.zeros(2, dtype=torch.int64), None, "softmax", catalogue=catalogue())
    with pytest.raises(ValueError, match="two_tower"):
        crossing(batch)
    every = random_batch(2, seed=1, spec=SPEC)
    t = int(every.sequences["history"].lengths().sum())
    every.next_items = NextItemTargets(True, torch.zeros(t, dtype=torch.int64), None, "softmax", catalogue=catalogue())
    with pytest.raises(ValueError, match="queries"):
        two_tower()(every)


def test_a_shared_item_table_embeds_the_candidate_id_through_the_history_table():
    m = two_tower(shared=True).train()
    history_table = m.encoder.embedding.events["width32"].embeddings["t_history_item_id"].weight
    assert [c.name for c in m.item_tower.bags.embedding_bag_configs()] == ["item_tower_t_item_attributes"]  # no id table of its own
    table = catalogue()
    attributes = m.item_tower.bags(KeyedJaggedTensor.from_lengths_sync(
        keys=["item_attributes"], values=table["item_attributes"].values(), lengths=table["item_attributes"].lengths()))
    expected = m.item_tower.project(torch.cat([history_table, attributes["item_attributes"]], 1))
    torch.testing.assert_close(m.item_vectors(table), expected)
    # training reads the catalogue's ids in the history's lookup: the softmax's gradient reaches every item's row
    requests = random_batch(4, seed=5, max_events=6, spec=SHARED_SPEC)
    requests.next_items = NextItemTargets(False, torch.tensor([1, 2, 3, 4]), None, "softmax", catalogue=table)
    next_item_loss(m(requests).logits, requests.next_items).backward()
    seen = requests.sequences["history"].ids["history_item_id"].values().unique()
    unseen = torch.tensor(sorted(set(range(NUM_ITEMS)) - set(seen.tolist())))
    assert unseen.numel() > 0 and (history_table.grad[unseen].abs().sum(1) > 0).all()


def test_the_cosine_score_is_the_scaled_cosine_of_the_two_towers_and_learns_its_scale():
    dot, cosine = two_tower(), two_tower(score="cosine")  # the same weights (same seed), plus the scale
    cosine.cosine.log_scale.data.fill_(1.5)
    requests = random_batch(4, seed=3, max_events=6, spec=SPEC)
    requests.next_items = NextItemTargets(False, torch.tensor([1, 2, 3, 4]), None, "softmax", catalogue=catalogue())
    with torch.no_grad():
        query = dot(requests).representation
        items = dot.item_vectors(catalogue())
    expected = torch.exp(torch.tensor(1.5)) * F.normalize(query, dim=-1) @ F.normalize(items, dim=-1).t()
    out = cosine(requests)  # eval mode, as dot: training-mode MoE capacity would differ between the two
    torch.testing.assert_close(out.logits, expected)
    next_item_loss(out.logits, requests.next_items).backward()
    assert cosine.cosine.log_scale.grad is not None and cosine.cosine.log_scale.grad.abs().item() > 0
    cosine.cosine.log_scale.data.fill_(10.0)  # capped: the softmax cannot sharpen without bound
    with torch.no_grad():
        torch.testing.assert_close(cosine(requests).logits, 100.0 * expected / torch.exp(torch.tensor(1.5)))
    with pytest.raises(ValueError, match="score must be 'dot' or 'cosine'"):
        KunlunConfig(two_tower=True, score="l2")
    with pytest.raises(ValueError, match="'cosine' needs two_tower"):
        KunlunConfig(score="cosine")


def test_a_shared_item_table_is_checked():
    with pytest.raises(ValueError, match="share_item_table needs two_tower"):
        KunlunConfig(share_item_table=True)
    with pytest.raises(ValueError, match="FeatureSpec.shared_ids is empty"):
        KunlunModel(SPEC, KunlunConfig(max_seq_len=8, block_size=4, window=4, two_tower=True, share_item_table=True))
    with pytest.raises(ValueError, match="has 30 ids, 'history_attributes_0' 7"):
        dataclasses.replace(SPEC, shared_ids=(("item_id", "history_attributes_0"),))


@pytest.mark.parametrize("candidate_dense", [(1, 2), (0, 2)])
def test_two_tower_request_side_leaves_the_candidates_dense_columns_out(candidate_dense):
    # the candidate's float fields in the batch's dense (as a next-item data set with item floats assembles it):
    # a query that read them would see the item it is to find
    spec = dataclasses.replace(SPEC, num_dense=3, candidate_dense=candidate_dense)
    torch.manual_seed(0)
    m = KunlunModel(spec, KunlunConfig(two_tower=True, num_layers=1, max_seq_len=8, block_size=4, window=4)).eval()
    requests = random_batch(4, seed=9, max_events=6, spec=spec)
    request_column = ({0, 1, 2} - set(candidate_dense)).pop()

    def representation(dense):
        return m.trunk(*m.encoder(dataclasses.replace(requests, dense=dense)))[0]

    with torch.no_grad():
        other_item = requests.dense.clone()
        other_item[:, list(candidate_dense)] += 5.0
        torch.testing.assert_close(representation(requests.dense), representation(other_item))
        other_user = requests.dense.clone()
        other_user[:, request_column] += 5.0
        assert not torch.allclose(representation(requests.dense), representation(other_user))
    with pytest.raises(ValueError, match=r"candidate_dense must name distinct dense columns in \[0, 3\)"):
        dataclasses.replace(spec, candidate_dense=(3,))
