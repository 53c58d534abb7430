"""Batch streams: the synthetic data set as a rank-sharded, exactly resumable sequence of batches."""

from __future__ import annotations

from collections.abc import Iterator

from gem_kunlun import Batch

from gem_data.synthetic import SyntheticGenerator


class SyntheticStream:
    """An endless stream of training batches for one rank.

    Rank ``r`` of ``world_size`` takes global batches ``r, r + world_size, r + 2 * world_size, ...``: no
    two ranks see the same batch and none is skipped. ``state_dict`` holds the position, so a restarted run
    continues at exactly the next batch.
    """

    def __init__(self, generator: SyntheticGenerator, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}")
        self.generator, self.batch_size, self.rank, self.world_size = generator, batch_size, rank, world_size
        self.position = 0

    def __iter__(self) -> Iterator[Batch]:
        while True:
            index = self.position * self.world_size + self.rank
            self.position += 1
            yield self.generator.batch(index, self.batch_size, split="train")

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"data state was saved with world_size={state['world_size']}, resuming with {self.world_size}"
            )
        self.position = int(state["position"])


def eval_batches(generator: SyntheticGenerator, batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1):
    """The held-out split: ``num_batches`` global batches, this rank's share of them."""
    for index in range(rank, num_batches, world_size):
        yield generator.batch(index, batch_size, split="eval")
