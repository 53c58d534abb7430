"""Two Gloo ranks against one process for the models and data layouts beyond the default Kunlun: a two-tower
Kunlun sharing its item table on Beauty, uneven per-rank shares of a surface filter, InterFormer, domain experts
with a domain missing from a rank, and contrastive views with padded expert parallelism."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from gem_data import SyntheticStream
from gem_trainer.builders import build_generator
from gem_trainer.config import load_config
from parity_runs import BASE, assert_close_states, final_state, logged, losses, train

pytestmark = pytest.mark.slow


def test_two_ranks_of_a_two_tower_kunlun_sharing_its_item_table_equal_one_process(tmp_path):
    """The item tower reads the history's item table (one table, two features): sharded over 2 ranks, each step
    looks the history and the whole catalogue up in one call, as one process does."""
    from gem_data.testing import find_repo_root, shared_data_dir

    beauty = shared_data_dir(find_repo_root(Path(__file__))) / "beauty"
    if not beauty.is_dir():
        pytest.skip(f"shared real data not found at {beauty} (expected ../shared/data beside the repository)")
    config = Path(__file__).resolve().parents[1] / "configs" / "beauty-kunlun.toml"
    steps = 10
    overrides = [f"--config={config}", f"--data.path={beauty}", "--model.kunlun.share_item_table=true",
                 "--data.sequential.eval_users=200", '--data.sequential.eval_protocols=["sampled"]',
                 "--model.kunlun.dropout=0",  # dropout masks are drawn per rank
                 f"--schedule.steps={steps}"]
    train(tmp_path / "one", 1, *overrides)
    train(tmp_path / "two", 2, *overrides)
    ours, theirs = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(ours) == steps
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    state, expected = final_state(tmp_path / "two", steps), final_state(tmp_path / "one", steps)
    assert any("t_history_item_id" in key for key in state) and not any("item_tower_t_item_id" in key for key in state)
    # NOTE: a softmax over the catalogue does not change when every item vector moves by one vector: the item
    # tower's bias has an exact gradient of zero (its Adam state and value only hold summation-order rounding)
    assert all(key in state for key in [k for k in expected if "item_tower.project.bias" in k])
    assert_close_states(*({k: v for k, v in s.items() if "item_tower.project.bias" not in k} for s in (state, expected)))
    evaluated, wanted = (json.loads((tmp_path / run / "eval.json").read_text()) for run in ("two", "one"))
    assert evaluated["sampled/hr@10"] == pytest.approx(wanted["sampled/hr@10"], abs=1e-6)


@pytest.mark.parametrize("case", ["uneven surface shares", "interformer"])
def test_two_ranks_equal_one_process_with_uneven_shares_and_an_interformer(tmp_path, case):
    """A surface filter's ranks hold slices differing by one example (each rank's loss weighted by its share of the
    global batch, as one process averages); InterFormer's first summary runs inside its sharded first layer."""
    steps = 4
    overrides = {"uneven surface shares": ["--data.train_surfaces=[1]", "--model.kunlun.capacity_factor=0"],
                 "interformer": ["--model.name=interformer"]}[case]
    overrides += [f"--schedule.steps={steps}", "--data.synthetic.max_events=8"]
    train(tmp_path / "one", 1, *overrides)
    train(tmp_path / "two", 2, *overrides)
    ours, theirs = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(ours) == len(theirs) == steps
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(tmp_path / "two", steps), final_state(tmp_path / "one", steps))
    # the logged throughput counts every rank's examples (the ranks' slices differ by one example)
    assert logged(tmp_path / "two", "examples") == logged(tmp_path / "one", "examples")


def test_two_ranks_of_domain_experts_with_a_domain_missing_from_a_rank_equal_one_process(tmp_path):
    """Each domain's experts see a different number of its rows on each rank, and none where a rank's slice lacks
    the domain (a stand-in row runs there, so that every rank runs the same modules): the MoE balance loss, the
    expert fractions and the capacity are those of the domain's rows of the global batch, as one process counts."""
    steps = 4
    overrides = ["--model.name=domain_experts", "--model.domain_experts.num_shared=1", "--model.kunlun.num_layers=1",
                 "--model.kunlun.balance_loss_weight=0.5", "--data.batch_size=4", f"--schedule.steps={steps}",
                 "--data.synthetic.max_events=8", "--data.synthetic.num_surfaces=3"]
    generator = build_generator(load_config(overrides=[*BASE, *overrides]))
    ranks_surfaces = [[set(b.surface.tolist()) for b in itertools.islice(SyntheticStream(generator, 4, rank, 2), steps)]
                      for rank in range(2)]
    assert any(a != b for a, b in zip(*ranks_surfaces)), "no step with a domain on one rank only: the test tests nothing"
    train(tmp_path / "one", 1, *overrides, "--data.batch_size=8")
    train(tmp_path / "two", 2, *overrides)
    ours, theirs = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(ours) == len(theirs) == steps
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(tmp_path / "two", steps), final_state(tmp_path / "one", steps))


@pytest.mark.parametrize("experts", ["exact", "padded"])
def test_contrastive_views_train_on_two_ranks(tmp_path, experts):
    """A contrastive weight runs the trunk on two views of every example: each MoE receives twice a rank's examples,
    and the capacity's global bound and padded expert parallelism's messages count those rows. (Each rank contrasts
    its own examples and draws its own dropout masks, so two ranks are not one process here.)"""
    overrides = ["--model.kunlun.contrastive_weight=0.1", "--model.kunlun.dropout=0.1", "--schedule.steps=3",
                 "--data.synthetic.max_events=8"]
    if experts == "padded":
        overrides += ["--parallelism.expert=2", "--parallelism.expert_padded=true"]
    train(tmp_path, 2, *overrides)
    assert len(ours := losses(tmp_path)) == 3 and all(torch.isfinite(torch.tensor(ours)))
