"""Ranking many candidates for one request with Kunlun: the user side once, the crossing trunk per candidate.

Kunlun crosses the candidate with the history in every layer (the pFFN turns the non-sequence tokens, the
candidate's among them, into weights applied to every event), so nothing after the encoder can be shared
between candidates. What is shared is the input side of the history: its embedding lookups, the per-event-
type encoders, the time-ordered merge and the truncation, computed once per request and repeated for each of
its candidates; the non-sequence tokens come from each candidate's own features (its id and attribute bags,
which only the data knows, hence ``candidate_features``).
"""

from __future__ import annotations

import torch

from gem_kunlun.batch import Batch
from gem_kunlun.sequence import jagged_slices


def repeat_jagged(offsets: torch.Tensor, times: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index ``[T']`` into a jagged tensor's rows and new offsets ``[B * times + 1]`` that repeat each of its
    ``B`` sequences ``times`` times in a row (sequence 0 ``times`` times, then sequence 1, ...)."""
    lengths = (offsets[1:] - offsets[:-1]).repeat_interleave(times)
    return jagged_slices(offsets[:-1].repeat_interleave(times), lengths)


@torch.no_grad()
def kunlun_score_candidates(model, requests: Batch, candidates: torch.Tensor, candidate_features: Batch,
                            rows_per_call: int = 4096) -> torch.Tensor:
    """``[U, C]`` first-task logits of ``candidates [U, C]`` for the ``U`` request rows of ``requests``.

    ``candidate_features`` has ``U * C`` rows in row-major order (user 0's candidates first) carrying each
    candidate's non-sequence features (its history is ignored; an empty one is cheapest). The trunk runs on
    ``rows_per_call`` (user, candidate) rows at a time, each group of whole users.
    """
    u, c = candidates.shape
    request_tokens, seq, offsets, positions = model.encoder(requests)
    sparse, dense, _ = model.encoder.embedding(candidate_features)
    x = torch.cat([sparse, dense[:, None]], 1)
    # the request's tokens past its non-sequence features' (one per representation feature: the user's, not the
    # candidate's) go with each of its candidates
    user_tokens = request_tokens[:, x.shape[1]:]
    if user_tokens.shape[1]:
        x = torch.cat([x, user_tokens.repeat_interleave(c, 0).to(x.dtype)], 1)
    users_per_call = max(1, rows_per_call // max(c, 1))
    scores = []
    for start in range(0, u, users_per_call):
        stop = min(start + users_per_call, u)
        index, call_offsets = repeat_jagged(offsets[start : stop + 1] - offsets[start], c)
        first = int(offsets[start])
        rows = slice(start * c, stop * c)
        representation, _ = model.trunk(x[rows], seq[first + index], call_offsets, positions[first + index])
        scores.append(model.heads(representation, candidate_features.surface[rows])[:, 0])
    return torch.cat(scores).view(u, c) if scores else x.new_zeros(u, c)
