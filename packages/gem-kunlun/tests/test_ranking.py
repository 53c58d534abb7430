import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, JaggedFloats, KunlunConfig, KunlunModel
from gem_kunlun.ranking import repeat_jagged
from gem_kunlun.testing import SPEC, SPEC_WITH_REPRESENTATIONS, random_batch


def expand(requests: Batch, candidate_features: Batch, times: int) -> Batch:
    """One row per (request, candidate): each request's histories repeated ``times`` times, each row's
    non-sequence features and surface from ``candidate_features``."""
    sequences = {}
    for name, seq in requests.sequences.items():
        index, offsets = repeat_jagged(seq.offsets(), times)
        lengths = offsets[1:] - offsets[:-1]
        parts = seq.ids.to_dict()
        ids = KeyedJaggedTensor.from_lengths_sync(
            keys=list(parts), values=torch.cat([jt.values()[index] for jt in parts.values()]), lengths=lengths.repeat(len(parts))
        )
        sequences[name] = EventSequence(ids, seq.timestamps[index])
    representations = {}  # the user's, like the history
    for name, vectors in requests.representations.items():
        index, offsets = repeat_jagged(vectors.offsets(), times)
        representations[name] = JaggedFloats(vectors.values[index], offsets[1:] - offsets[:-1])
    return Batch(candidate_features.dense, candidate_features.sparse, sequences, candidate_features.labels, candidate_features.surface,
                 representations=representations)


def test_repeat_jagged_repeats_each_sequence_in_place():
    index, offsets = repeat_jagged(torch.tensor([0, 2, 2, 5]), 2)
    assert index.tolist() == [0, 1, 0, 1, 2, 3, 4, 2, 3, 4]
    assert offsets.tolist() == [0, 2, 4, 4, 4, 7, 10]


@pytest.mark.parametrize("spec", [SPEC, SPEC_WITH_REPRESENTATIONS], ids=["plain", "representations"])
def test_kunlun_score_candidates_equals_forward_on_the_expanded_rows(spec):
    torch.manual_seed(0)
    model = KunlunModel(spec, KunlunConfig(max_seq_len=8, block_size=4, window=4)).eval()
    users, per_user = 4, 5
    requests = random_batch(users, seed=1, max_events=12, spec=spec)  # some histories get truncated
    candidate_features = random_batch(users * per_user, seed=2, spec=spec)
    candidates = torch.arange(users * per_user).view(users, per_user)  # ids are unused: the features carry them
    with torch.no_grad():
        fast = model.score_candidates(requests, candidates, candidate_features)
        slow = model(expand(requests, candidate_features, per_user)).logits[:, 0].view(users, per_user)
    torch.testing.assert_close(fast, slow)
