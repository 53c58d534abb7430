"""Helpers for tests of gem-data and its users: where the shared real data lives, batch fingerprints, small
sequence corpora, a resumable source that fails."""

from __future__ import annotations

from pathlib import Path

import torch

from gem_kunlun import Batch, NextItemTargets


def shared_data_dir(repo_root: str | Path) -> Path:
    """``../shared/data`` beside the repository root: the real data sets (never copied into the repo)."""
    return Path(repo_root).resolve().parent / "shared" / "data"


def find_repo_root(start: str | Path) -> Path:
    """The nearest folder above ``start`` holding ``hatch.toml`` (the monorepo root)."""
    start = Path(start).resolve()
    for folder in (start, *start.parents):
        if (folder / "hatch.toml").is_file():
            return folder
    raise FileNotFoundError(f"no hatch.toml above {start}")


def example_fingerprints(batch: Batch) -> list[tuple]:
    """One hashable tuple per example (its ids, event ids, labels, surface): compares streams example by example."""
    rows = []
    sparse = {k: (jt.values(), jt.offsets()) for k, jt in batch.sparse.to_dict().items()}
    events = {k: (jt.values(), jt.offsets()) for s in batch.sequences.values() for k, jt in s.ids.to_dict().items()}
    for i in range(batch.batch_size):
        ids = tuple(tuple(v[o[i] : o[i + 1]].tolist()) for v, o in (*sparse.values(), *events.values()))
        rows.append((ids, tuple(batch.labels[i].tolist()), int(batch.surface[i]), tuple(batch.dense[i].tolist())))
    return rows


def equal_batches(a: Batch, b: Batch) -> bool:
    """Exact equality of two batches, field by field."""
    same_sequences = a.sequences.keys() == b.sequences.keys() and all(
        torch.equal(a.sequences[k].ids.values(), b.sequences[k].ids.values())
        and torch.equal(a.sequences[k].ids.lengths(), b.sequences[k].ids.lengths())
        and torch.equal(a.sequences[k].timestamps, b.sequences[k].timestamps)
        for k in a.sequences
    )
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
        and same_sequences
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.surface, b.surface)
        and ((a.source is None and b.source is None) or (a.source is not None and b.source is not None and torch.equal(a.source, b.source)))
        and a.representations.keys() == b.representations.keys()
        and all(torch.equal(a.representations[k].values, b.representations[k].values)
                and torch.equal(a.representations[k].lengths, b.representations[k].lengths) for k in a.representations)
        and _equal_targets(a.next_items, b.next_items)
    )


def _equal_targets(a: NextItemTargets | None, b: NextItemTargets | None) -> bool:
    """Retrieval targets equal: the same queries, positives and negatives, and catalogues of the same items."""
    if a is None or b is None:
        return a is b
    same_negatives = (a.negatives is None and b.negatives is None) or (
        a.negatives is not None and b.negatives is not None and torch.equal(a.negatives, b.negatives))
    same_catalogue = (a.catalogue is None and b.catalogue is None) or (
        a.catalogue is not None and b.catalogue is not None and a.catalogue.keys() == b.catalogue.keys()
        and torch.equal(a.catalogue.values(), b.catalogue.values()) and torch.equal(a.catalogue.lengths(), b.catalogue.lengths()))
    return a.every == b.every and a.loss == b.loss and torch.equal(a.positives, b.positives) and same_negatives and same_catalogue


def with_event_times(corpus):
    """``corpus`` with event times (a sequence file has none): user ``u``'s ``k``-th event at ``10 k + u`` seconds, so
    users' events interleave in time."""
    import dataclasses

    from gem_kunlun import segment_ids

    users = segment_ids(corpus.lengths())
    position = torch.arange(users.numel()) - corpus.offsets[users]
    return dataclasses.replace(corpus, timestamps=(10 * position + users).double(), timed=True)


def small_corpus(folder: str | Path, name: str, users: int, items: int, attributes: bool):
    """A deterministic sequence corpus of ``users`` histories (4-8 events) over ``items`` items, written to
    ``folder/name.txt`` (with ``name.json`` item attributes when asked) and read back."""
    from gem_data.readers.text import read_sequence_text

    folder = Path(folder)
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k) % items) for k in range(4 + u % 5)) for u in range(1, users + 1)]
    (folder / f"{name}.txt").write_text("\n".join(lines) + "\n")
    if attributes:
        (folder / f"{name}.json").write_text("{" + ", ".join(f'"{i}": [{i % 5}]' for i in range(1, items + 1)) + "}")
    return read_sequence_text(folder / f"{name}.txt", folder / f"{name}.json" if attributes else None)


class FailingSource:
    """A resumable source of ``generator``'s batches of ``batch_size`` that raises ``error`` when it comes to batch
    ``at`` (None: never) and ends before batch ``length`` (None: endless): a reader's error, or its end, as the
    readers ahead meet them."""

    def __init__(self, generator, error: Exception | None, at: int | None = 2, length: int | None = None,
                 batch_size: int = 4) -> None:
        self.spec, self.generator, self.error, self.at = generator.spec, generator, error, at
        self.length, self.batch_size, self.position = length, batch_size, 0

    def __iter__(self):
        index = self.position
        while self.length is None or index < self.length:
            if index == self.at:
                raise self.error
            self.position = index + 1
            yield self.generator.batch(index, self.batch_size)
            index += 1

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
