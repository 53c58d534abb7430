import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, EventType, FeatureSpec, SasrecConfig, SasrecModel, SparseFeature
from gem_kunlun.testing import random_batch, select_example

NUM_ITEMS = 40
SPEC = FeatureSpec(
    num_dense=0,
    sparse=(SparseFeature("item_id", NUM_ITEMS), SparseFeature("item_category", 8)),  # SASRec reads ids only
    events=(EventType("history", (SparseFeature("history_item_id", NUM_ITEMS),)),),
    tasks=("next_item",),
)
CONFIG = SasrecConfig(dim=16, num_blocks=2, num_heads=2, dropout=0.3, max_seq_len=6, rows_per_group=3)


def model(config: SasrecConfig = CONFIG) -> SasrecModel:
    torch.manual_seed(0)
    return SasrecModel(SPEC, config).eval()


def with_candidates(batch: Batch, items: torch.Tensor) -> Batch:
    """``batch`` with its candidate item ids replaced by ``items [B]``."""
    category = batch.sparse["item_category"]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "item_category"], values=torch.cat([items, category.values()]),
        lengths=torch.cat([torch.ones_like(items), category.lengths()]),
    )
    return Batch(batch.dense, sparse, batch.sequences, batch.labels, batch.surface)


def test_score_candidates_equals_forward_on_every_user_candidate_pair():
    m = model()
    requests = random_batch(5, seed=1, max_events=9, spec=SPEC)  # some histories exceed max_seq_len, some are empty
    candidates = torch.randint(NUM_ITEMS, (5, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = m.score_candidates(requests, candidates)
        for column in range(candidates.shape[1]):
            slow = m(with_candidates(requests, candidates[:, column])).logits[:, 0]
            torch.testing.assert_close(fast[:, column], slow)


def test_an_example_scores_the_same_alone_and_in_a_batch_of_other_lengths():
    # length groups pad each group separately; padding must never leak into a real token
    m = model()
    batch = random_batch(11, seed=3, max_events=9, spec=SPEC)
    with torch.no_grad():
        together = m(batch).logits
        alone = torch.cat([m(select_example(batch, i)).logits for i in range(batch.batch_size)])
    torch.testing.assert_close(together, alone)
    assert torch.isfinite(together).all()


def test_only_the_latest_max_seq_len_items_matter():
    m = model()
    recent = torch.tensor([3, 4, 5, 6, 7, 8])
    rows = []
    for older in (torch.tensor([1, 2]), torch.tensor([9, 10, 11])):
        items = torch.cat([older, recent])
        ids = KeyedJaggedTensor.from_lengths_sync(keys=["history_item_id"], values=items, lengths=torch.tensor([items.numel()]))
        candidate = KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "item_category"], values=torch.tensor([12, 3]), lengths=torch.tensor([1, 1]))
        rows.append(Batch(torch.zeros(1, 0), candidate, {"history": EventSequence(ids, torch.arange(items.numel()).float())},
                          torch.ones(1, 1), torch.zeros(1, dtype=torch.int64)))
    with torch.no_grad():
        torch.testing.assert_close(m(rows[0]).logits, m(rows[1]).logits)


def test_history_and_candidate_share_one_item_table_and_the_model_learns():
    m = model(SasrecConfig(dim=16, num_blocks=1, num_heads=2, dropout=0.0, max_seq_len=6))
    tables = [t for t in m.items.embedding_configs()]
    assert len(tables) == 1 and tables[0].feature_names == ["history_item_id", "item_id"]
    # a deterministic rule: the next item is the last one plus one; negatives are random
    g = torch.Generator().manual_seed(4)
    m.train()
    optimizer = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for step in range(60):
        batch = random_batch(64, seed=100 + step, max_events=5, spec=SPEC)
        history = batch.sequences["history"]
        ends = history.offsets()[1:] - 1
        last = torch.where(history.lengths() > 0, history.ids.values()[ends.clamp(min=0)], torch.zeros_like(ends))
        positive = torch.rand(64, generator=g) < 0.5
        items = torch.where(positive, (last + 1) % NUM_ITEMS, torch.randint(NUM_ITEMS, (64,), generator=g))
        labels = (items == (last + 1) % NUM_ITEMS).float()[:, None]
        logits = m(with_candidates(batch, items)).logits
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10  # from ln 2 (chance)


def test_config_and_spec_are_checked():
    with pytest.raises(ValueError, match="divisible"):
        SasrecConfig(dim=10, num_heads=3)
    other = FeatureSpec(num_dense=0, sparse=(SparseFeature("item_id", 5),),
                        events=(EventType("history", (SparseFeature("history_item_id", 6),)),), tasks=("t",))
    with pytest.raises(ValueError, match="share one item table"):
        SasrecModel(other, CONFIG)


def every_position_step(layout: str, vectors: torch.Tensor, lengths: torch.Tensor, upstream: torch.Tensor):
    """Every-position outputs of ``vectors`` (jagged by ``lengths``) in ``layout``, and the gradients of
    ``(outputs * upstream).sum()`` for the vectors and every parameter."""
    m = model(SasrecConfig(dim=16, num_blocks=2, num_heads=2, dropout=0.0, max_seq_len=6, rows_per_group=3, layout=layout))
    m.train()
    vectors = vectors.clone().requires_grad_()
    outputs = m.position_representations(vectors, lengths)
    (outputs * upstream).sum().backward()
    return outputs, vectors.grad, {name: p.grad for name, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_padded_every_position_encoder_computes_what_the_length_groups_do(seed):
    # the padded layout (a GPU's, fixed shapes: what CUDA graphs replay) against length groups, on random lengths
    # including empty histories and histories of exactly max_seq_len
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.tensor([0, 6]), torch.randint(0, 7, (9,), generator=g)])
    vectors = torch.randn(int(lengths.sum()), 16, generator=g)
    upstream = torch.randn(int(lengths.sum()), 16, generator=g)
    padded, grouped = (every_position_step(layout, vectors, lengths, upstream) for layout in ("padded", "grouped"))
    torch.testing.assert_close(padded[0], grouped[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[1], grouped[1], rtol=1e-5, atol=1e-5)
    assert padded[2].keys() == grouped[2].keys() and "position" in padded[2]
    for name in grouped[2]:
        torch.testing.assert_close(padded[2][name], grouped[2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_padded_encoder_rejects_more_events_than_its_rows_hold():
    m = model(SasrecConfig(dim=16, num_blocks=1, num_heads=2, max_seq_len=6, layout="padded"))
    with pytest.raises(ValueError, match="max_seq_len"):
        m._encode(torch.randn(15, 16), torch.tensor([7, 8]), every=True)


def test_flops_count_the_blocks_over_the_kept_lengths_and_the_scores():
    m = model()
    batch = random_batch(7, seed=4, max_events=9, spec=SPEC)  # some histories exceed max_seq_len (6)
    lengths = batch.sequences["history"].lengths().clamp(max=6).double()
    tokens, pairs, d = float(lengths.sum()), float((lengths * (lengths + 1) / 2).sum()), 16
    per_block = 2.0 * d * 3 * d * tokens + 4.0 * d * pairs + 2.0 * d * d * tokens + 4.0 * d * d * tokens
    assert m.flops(batch) == {"block0": per_block, "block1": per_block, "score": 2.0 * d * 7}


def test_an_example_without_exactly_one_candidate_is_refused():
    """The candidates are read one per example, in order: counts [0, 2, 1] (the same total) paired example 0 with
    example 1's candidate without a word."""
    batch = random_batch(3, seed=1, max_events=5, spec=SPEC)
    ids, category = batch.sparse["item_id"].values(), batch.sparse["item_category"]
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "item_category"],
                                                 values=torch.cat([ids, category.values()]),
                                                 lengths=torch.cat([torch.tensor([0, 2, 1]), category.lengths()]))
    with pytest.raises(ValueError, match=r"one candidate per example: batch.sparse\['item_id'\]"):
        model()(Batch(batch.dense, sparse, batch.sequences, batch.labels, batch.surface))
