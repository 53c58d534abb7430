"""The one-request-many-candidates contract: models that score a user's candidates with the user side computed
once say so through ``CandidateScorer``, and say what of a candidate they read (``CandidateInput``)."""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import torch

from gem_kunlun.batch import Batch


class CandidateInput(enum.Enum):
    """What ``score_candidates`` reads of the candidates besides their ids."""

    IDS = "ids"  # nothing: the item ids index the model's own item table (SASRec)
    FEATURES = "features"  # each candidate's own features, one row per (request, candidate) (crossing Kunlun)
    CATALOGUE = "catalogue"  # every item's candidate features once, for an item tower (two-tower Kunlun)


@runtime_checkable
class CandidateScorer(Protocol):
    """``score_candidates(requests [U rows], candidates [U, C], **inputs) -> [U, C]`` logits, where ``inputs``
    is ``candidate_features`` (a batch of ``U * C`` rows) or ``catalogue`` (a KJT of every item) as
    ``candidate_input`` says."""

    candidate_input: CandidateInput

    def score_candidates(self, requests: Batch, candidates: torch.Tensor, **inputs) -> torch.Tensor: ...
