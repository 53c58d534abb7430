"""LoopFM on next-item data: a two-tower teacher trained without user ids; `posttrain` keys its query vectors by the
user id that only the store reads (`loopfm.key_only`), each training prefix once over two epochs; the student reads
each prefix's earlier ones in training and in ranking evaluation, as the Beauty section of bench_transfer does."""

import pytest
import torch

from gem_trainer import builders
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.posttrain import posttrain
from gem_trainer.trainer import Trainer
from gem_transfer import RepresentationStore, example_times, random_projection, without_sparse_key

STUDENT = ["--model.kunlun.d_model=16", "--model.kunlun.num_layers=1", "--model.kunlun.hidden=[16]",
           "--data.sequential.num_negatives=3"]  # a narrower student of the shared retrieval teacher
KEYED = ["--data.sequential.with_user_id=true", "--loopfm.key_only=true"]
MAX_EVENTS = 32  # more than any user's prefixes: every earlier one is read


@pytest.fixture(scope="module")
def corpus(retrieval_teacher, tmp_path_factory):
    """The shared teacher (trained without user ids) and the store of its pass over two epochs of the student's
    stream, with its top-5 soft labels."""
    shared, data = retrieval_teacher
    folder = tmp_path_factory.mktemp("loopfm-next-item")
    (folder / "teacher").symlink_to(shared / "teacher")  # the stores and runs of these tests beside it
    written = posttrain(student_config(folder / "pass", data, *KEYED, "--schedule.epochs=2", f"--loopfm.store={folder / 'loopfm'}",
                                       f"--distillation.teacher_run_dir={folder / 'teacher'}",
                                       f"--distillation.soft_labels={folder / 'labels'}", "--distillation.top_k=5"),
                        init_distributed("cpu", "gloo"))
    return folder, data, written


def student_config(run_dir, data, *extra):
    return load_config(None, [f"--run_dir={run_dir}", "--schedule.steps=6", *data, *STUDENT, *extra])


def test_the_pass_stores_each_training_prefix_once_as_the_teachers_query_vector(corpus):
    folder, data, written = corpus
    env = init_distributed("cpu", "gloo")
    config = student_config(folder / "look", data, *KEYED, f"--loopfm.store={folder / 'loopfm'}",
                            f"--distillation.teacher_run_dir={folder / 'teacher'}")
    setup = builders.build_data(config, env, representations=False)
    prefixes = setup.ranking.num_training_examples
    assert written["rows"] > prefixes  # two epochs went by: each prefix met twice, with other negatives
    store = RepresentationStore(folder / "loopfm")
    assert store.rows == prefixes
    assert "user_id" not in {f["name"] for f in store.meta["spec"]["sparse"]}  # the models' view: no user ids
    pairs = set(zip(store.user.tolist(), store.time.tolist()))
    assert len(pairs) == prefixes  # one per (user, time of the prefix's newest item): every prefix once

    # step 0's vectors are the teacher's query vectors of the student's first batch, read without the user id
    batch = next(iter(setup.train))
    teacher, _ = builders.build_teacher(config, builders.model_spec(config, setup.spec), env)
    with torch.no_grad():
        query = teacher(without_sparse_key(batch, "user_id")).representation.float()
    expected = query @ random_projection(query.shape[1], 16, 0)
    stored_users, stored_times = torch.from_numpy(store.user), torch.from_numpy(store.time)
    found = [int(((stored_users == u) & (stored_times == t)).nonzero()[0])  # each row found by (user, time)
             for u, t in zip(batch.sparse["user_id"].values(), example_times(batch))]
    torch.testing.assert_close(store.vectors[found], expected, rtol=1e-5, atol=1e-5)


def test_the_student_reads_earlier_prefixes_in_training_and_in_ranking_evaluation(corpus, tmp_path):
    folder, data, _ = corpus
    config = student_config(tmp_path / "student", data, *KEYED, f"--loopfm.store={folder / 'loopfm'}",
                            f"--loopfm.max_events={MAX_EVENTS}", f"--distillation.soft_labels={folder / 'labels'}")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    try:
        assert [r.name for r in trainer.spec.representations] == ["loopfm"]
        assert "user_id" not in {f.name for f in trainer.spec.sparse}  # a key only: no table of user ids
        losses = [float(trainer.train_step()["loss"]) for _ in range(6)]  # distilled on the pass's labels too
        assert all(torch.isfinite(torch.tensor(losses)))
        batch = next(iter(trainer.data.train))
        batch.validate(trainer.spec)
        # prefix k (k items of history, times 0 .. k-1) reads the k - 1 prefixes before it
        history = batch.sequences["history"].lengths()
        short = history < 12  # a full window (max_history) may hide older items
        assert torch.equal(batch.representations["loopfm"].lengths[short], history[short] - 1)

        # an evaluated request of the test split (n - 1 items of history) reads all n - 3 training prefixes
        ranking = trainer.data.ranking
        examples = ranking.ranking_examples("test", "sampled", 20, 0)
        rows = torch.arange(8)
        users = examples.users[rows]
        requests = ranking.assemble(users, ranking.history(users, examples.history_length[rows]), examples.targets()[rows], torch.ones(8))
        requests.validate(trainer.spec)
        lengths = ranking.corpus.lengths()[users]
        assert torch.equal(requests.representations["loopfm"].lengths, (lengths - 3).clamp(max=MAX_EVENTS))
        result = trainer.evaluate()
        assert 0 <= result["sampled/hr@10"] <= 1 and result["sampled/users"] == examples.num_users
    finally:
        trainer.close()


def test_loopfm_on_next_item_data_that_cannot_work_is_one_line(corpus, tmp_path):
    folder, data, _ = corpus
    env = init_distributed("cpu", "gloo")
    with pytest.raises(ConfigError, match=r"loopfm.store on next-item data needs data.sequential.objective = \"retrieval\""):
        load_config(None, [f"--run_dir={tmp_path / 'a'}", *data, "--model.kunlun.two_tower=false", "--data.sequential.objective=pointwise",
                           "--data.sequential.loss=binary", f"--loopfm.store={folder / 'loopfm'}"])
    with pytest.raises(ConfigError, match=r"^loopfm.user_feature: user feature 'user_id' is not among the data's sparse features .*"
                                          r"data.sequential.with_user_id = true\)$"):
        posttrain(student_config(tmp_path / "b", data, f"--loopfm.store={tmp_path / 'new'}", f"--distillation.teacher_run_dir={folder / 'teacher'}"), env)
    with pytest.raises(ConfigError, match=r"^loopfm.store: .*written over data with other features than this run's$"):
        Trainer(student_config(tmp_path / "c", data, "--data.sequential.with_user_id=true", f"--loopfm.store={folder / 'loopfm'}"), env)
    with pytest.raises(ConfigError, match=r"^loopfm.store: user feature 'user_id' is not among the data's sparse features"):
        Trainer(student_config(tmp_path / "d", data, "--loopfm.key_only=true", f"--loopfm.store={folder / 'loopfm'}"), env)
