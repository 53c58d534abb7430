"""Ranking evaluation of one mixed source through the union spec."""

import torch

from gem_data import AlignedRanking, FeatureAlignment, NextItemConfig, NextItemDataset, read_sequence_text


def domain(folder, name, users, items):
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k) % items) for k in range(4 + u % 5)) for u in range(1, users + 1)]
    (folder / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return NextItemDataset(read_sequence_text(folder / f"{name}.txt"), NextItemConfig(num_negatives=1))


def test_candidates_and_batches_speak_union_ids(tmp_path):
    shop, films = domain(tmp_path, "shop", 20, 30), domain(tmp_path, "films", 12, 40)
    alignment = FeatureAlignment({"shop": shop.spec, "films": films.spec}, surfaces={"shop": 0, "films": 1})
    view = AlignedRanking(films, alignment, "films")
    offset = shop.corpus.num_items
    local = films.ranking_examples("test", "sampled", 9, seed=2)
    ranking = view.ranking_examples("test", "sampled", 9, seed=2)
    assert torch.equal(ranking.candidates, local.candidates + offset) and torch.equal(ranking.target_index, local.target_index)
    users = ranking.users[:4]
    requests = view.assemble(users, view.history(users, ranking.history_length[:4]), ranking.targets()[:4], torch.ones(4))
    requests.validate(view.spec)
    assert torch.equal(requests.sparse["item_id"].values(), ranking.targets()[:4])
    assert requests.surface.tolist() == [1, 1, 1, 1]
    assert requests.sequences["history"].ids["history_item_id"].values().min() >= offset
    rows = [(start, batch) for start, batch in view.scoring_batches(ranking, chunk_size=25)]
    items = torch.cat([batch.sparse["item_id"].values() for _, batch in rows])
    assert torch.equal(items, ranking.candidates.reshape(-1))
    assert torch.equal(torch.cat([b.labels[:, 0] for _, b in rows]).view(ranking.candidates.shape).argmax(1), ranking.target_index)
    assert view.sampler is films.sampler
