"""Two dropout views of each example and the contrastive loss between them.

On sparse data a representation trained on the next item alone overfits the few events of each item.
Encoding every example twice with independent dropout masks and pulling the two views together, against
the views of the batch's other examples (InfoNCE over ``2B`` vectors, as in SimCLR), asks the trunk for a
representation that a masked event does not move: a regulariser that costs one wider forward pass, since
both views travel as one batch of ``2B`` examples. The negatives are the views of the batch in hand: on several
ranks, each rank's own examples (fewer than one process holding the global batch has).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def two_views(x: torch.Tensor, seq: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor):
    """The trunk's inputs ``(x [B, N, D], seq [T, D], offsets [B+1], positions [T])`` stacked twice:
    examples ``B..2B-1`` repeat ``0..B-1``, so each gets its own dropout mask in the trunk."""
    doubled_offsets = torch.cat([offsets, offsets[1:] + offsets[-1]])
    return torch.cat([x, x]), torch.cat([seq, seq]), doubled_offsets, torch.cat([positions, positions])


def view_contrastive_loss(first: torch.Tensor, second: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE between ``first [B, R]`` and ``second [B, R]`` (row ``i`` of each: two views of example ``i``):
    each of the ``2B`` vectors must pick its other view among the other ``2B - 1`` by cosine similarity over
    ``temperature``. Mean over the ``2B`` vectors, in float32."""
    b = first.shape[0]
    z = F.normalize(torch.cat([first, second]).float(), dim=1)
    with torch.autocast(z.device.type, enabled=False):  # autocast would run the product in bf16 / fp16
        similarity = z @ z.t() / temperature
    # a vector is never its own candidate
    similarity = similarity.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float("-inf"))
    other_view = torch.cat([torch.arange(b, 2 * b), torch.arange(b)]).to(z.device)
    return F.cross_entropy(similarity, other_view)
