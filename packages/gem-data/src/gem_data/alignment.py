"""Feature alignment: sources with different ``FeatureSpec``s mapped into one union spec, batch by batch.

Sources are grouped into *id spaces*. Sources of one space share ids (the same item id means the same
item: two periods of one log, two objectives of one surface) and must declare the same features with the
same vocabularies. Different spaces are disjoint namespaces: a feature name several spaces declare becomes
one union feature whose id ranges are laid end to end (space 0's ids first, then space 1's, shifted by
space 0's vocabulary), so one table holds every domain's items without two domains ever sharing a row.
Dense features get a column block per space (zeros elsewhere). A sparse feature a source lacks is an empty
bag; an event feature its source lacks (while having the event type) gets a padding id, the last of the
union vocabulary, because an event feature carries exactly one id per event; an event type a source lacks
is empty. Every source must have the same tasks: the batch format has no label masks.

Nothing is copied ahead of time: ``align(name, batch)`` re-keys one batch (ids shifted, missing keys
filled) when it is read. Surfaces (domains) may be stamped per source, which is how a domain id reaches
the per-surface heads and the domain experts; the union's ``num_surfaces`` covers every stamp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gem_kunlun import Batch, EventType, FeatureSpec, SparseFeature

from gem_data.gathering import BatchView, KeyMap, Piece, SourcePlan, gather_pieces, gather_steps
from gem_data.source import spec_difference


class AlignmentError(ValueError):
    """Two sources cannot be mixed as declared; the message is one line naming both and the feature."""


class FeatureAlignment:
    """The union spec of ``specs`` (source name -> spec) and the mapping of each source's batches into it.

    ``id_spaces``: source name -> space name (sources missing from it are each their own space);
    ``surfaces``: source name -> domain id stamped on its examples (None or missing: the reader's own).
    Raises ``AlignmentError`` when the sources cannot be aligned as declared.
    """

    def __init__(self, specs: Mapping[str, FeatureSpec], id_spaces: Mapping[str, str] | None = None,
                 surfaces: Mapping[str, int | None] | None = None) -> None:
        if not specs:
            raise AlignmentError("no sources to align")
        self.names = list(specs)
        id_spaces, surfaces = dict(id_spaces or {}), dict(surfaces or {})
        for what, given in (("id_spaces", id_spaces), ("surfaces", surfaces)):
            unknown = [name for name in given if name not in specs]
            if unknown:
                raise AlignmentError(f"{what} names {unknown}, which are not among the sources {self.names}")
        negative = {name: stamp for name, stamp in surfaces.items() if stamp is not None and stamp < 0}
        if negative:
            raise AlignmentError(f"surfaces must be >= 0 (a domain id), got {negative}")
        self.source_specs = dict(specs)
        # a source left out of id_spaces is its own space, named after it: a declared space of that name would
        # silently join it (shared ids), so the ambiguity is refused
        taken = sorted({space for space in id_spaces.values()} & {name for name in self.names if name not in id_spaces})
        if taken:
            raise AlignmentError(f"id_spaces declares space(s) {taken}, the name of sources left out of id_spaces (each "
                                 f"its own space): give those sources their space in id_spaces, or name the declared one otherwise")
        self.space_of = {name: id_spaces.get(name, name) for name in self.names}
        spaces: dict[str, list[str]] = {}
        for name in self.names:
            spaces.setdefault(self.space_of[name], []).append(name)
        self.spaces = spaces
        first = self.names[0]
        for name in self.names[1:]:
            if specs[name].tasks != specs[first].tasks:
                raise AlignmentError(f"sources {first!r} and {name!r} have different tasks ({list(specs[first].tasks)} vs "
                                     f"{list(specs[name].tasks)}): the batch format has no label masks, so mixed sources need the same tasks")
        for space, members in spaces.items():
            for name in members[1:]:
                difference = spec_difference(_without_surfaces(specs[members[0]]), _without_surfaces(specs[name]))
                if difference:
                    raise AlignmentError(f"sources {members[0]!r} and {name!r} share id space {space!r} but their features "
                                         f"differ ({difference}); give them different id spaces to keep their ids apart")
        self._space_specs = {space: specs[members[0]] for space, members in spaces.items()}
        self.spec, plans = self._union(specs, surfaces)
        self._plans = plans

    # -- building the union ---------------------------------------------------------------------------------
    def _union(self, specs: Mapping[str, FeatureSpec], surfaces: Mapping[str, int | None]):
        space_specs = self._space_specs
        kinds: dict[str, tuple[str, str]] = {}  # feature -> (where it lives: "sparse" or an event type, first space)
        for space, spec in space_specs.items():
            places = [(f.name, "sparse") for f in spec.sparse] + [(f.name, e.name) for e in spec.events for f in e.features]
            for feature, place in places:
                seen = kinds.setdefault(feature, (place, space))
                if seen[0] != place:
                    where = lambda p: "a sparse feature" if p == "sparse" else f"a feature of event type {p!r}"  # noqa: E731
                    raise AlignmentError(f"feature {feature!r} is {where(seen[0])} in id space {seen[1]!r} but {where(place)} in "
                                         f"id space {space!r}; rename one of them")
        # offsets: per (feature, space), the ids of earlier spaces that declare the feature
        vocab: dict[str, int] = {}
        offsets: dict[tuple[str, str], int] = {}
        for space, spec in space_specs.items():
            for feature in [*spec.sparse, *(f for e in spec.events for f in e.features)]:
                offsets[(feature.name, space)] = vocab.get(feature.name, 0)
                vocab[feature.name] = vocab.get(feature.name, 0) + feature.num_embeddings
        sparse_names = _ordered(f.name for spec in space_specs.values() for f in spec.sparse)
        event_names = _ordered(e.name for spec in space_specs.values() for e in spec.events)
        event_features = {
            event: _ordered(f.name for spec in space_specs.values() for e in spec.events if e.name == event for f in e.features)
            for event in event_names
        }
        # an event feature that some space with that event type lacks needs a padding id
        padded = {
            feature for event, features in event_features.items() for feature in features
            if any(event in {e.name for e in spec.events} and (feature, space) not in offsets for space, spec in space_specs.items())
        }
        dense_offsets, num_dense = {}, 0
        for space, spec in space_specs.items():
            dense_offsets[space], num_dense = num_dense, num_dense + spec.num_dense
        num_surfaces = max(
            (surfaces[name] + 1) if surfaces.get(name) is not None else specs[name].num_surfaces for name in self.names
        )
        union = FeatureSpec(
            num_dense=num_dense,
            sparse=tuple(SparseFeature(n, vocab[n]) for n in sparse_names),
            events=tuple(
                EventType(event, tuple(SparseFeature(f, vocab[f] + (f in padded)) for f in features))
                for event, features in event_features.items()
            ),
            tasks=specs[self.names[0]].tasks,
            num_surfaces=num_surfaces,
            candidate=tuple(_ordered(c for spec in space_specs.values() for c in spec.candidate)),
            candidate_dense=tuple(dense_offsets[space] + i for space, spec in space_specs.items() for i in spec.candidate_dense),
            # ids two features share in every space still name the same things in the union (same offsets)
            shared_ids=tuple(pair for pair in space_specs[next(iter(space_specs))].shared_ids
                             if all(pair in spec.shared_ids for spec in space_specs.values())
                             and vocab[pair[0]] == vocab[pair[1]] + (pair[1] in padded)),
        )
        plans = {}
        for name in self.names:
            space = self.space_of[name]
            spec = space_specs[space]
            own_sparse = [f.name for f in spec.sparse]
            sparse = KeyMap.build([own_sparse.index(n) if n in own_sparse else -1 for n in sparse_names],
                                  [offsets.get((n, space), 0) for n in sparse_names], [-1] * len(sparse_names), len(own_sparse))
            events: dict[str, KeyMap | None] = {}
            own_events = {e.name: [f.name for f in e.features] for e in spec.events}
            for event, features in event_features.items():
                own = own_events.get(event)
                events[event] = None if own is None else KeyMap.build(
                    [own.index(f) if f in own else -1 for f in features], [offsets.get((f, space), 0) for f in features],
                    [-1 if f in own else vocab[f] for f in features], len(own))
            identity = dataclasses.replace(spec, num_surfaces=num_surfaces) == union
            plans[name] = SourcePlan(dense_offsets[space], sparse, events, surfaces.get(name), identity)
        self._offsets = offsets
        return union, plans

    # -- using it -------------------------------------------------------------------------------------------
    def offset(self, name: str, feature: str) -> int:
        """Where source ``name``'s ids of ``feature`` start in the union vocabulary."""
        return self._offsets[(feature, self.space_of[name])]

    def is_identity(self, name: str) -> bool:
        """Whether ``name``'s batches need no re-keying (its features are the union's)."""
        return self._plans[name].identity

    def keeps_rows(self, name: str) -> bool:
        """Whether ``name``'s rows enter the union batch as they are (no re-keying, no domain id stamped)."""
        plan = self._plans[name]
        return plan.identity and plan.surface is None

    def surfaces_of(self, name: str) -> range:
        """The surfaces (domain ids) source ``name``'s examples carry in the union: its stamp, or its reader's own."""
        stamp = self._plans[name].surface
        return range(stamp, stamp + 1) if stamp is not None else range(self.source_specs[name].num_surfaces)

    def shared_surfaces(self) -> list[tuple[str, str, list[int]]]:
        """``(source, source, surfaces)`` for every two sources of different id spaces whose examples can carry the
        same surface: they then share its head and its domain experts. Intended for two periods or surfaces of one
        log; for two data sets it usually means a stamp was left out."""
        pairs = []
        for i, a in enumerate(self.names):
            for b in self.names[i + 1:]:
                common = sorted(set(self.surfaces_of(a)) & set(self.surfaces_of(b)))
                if common and self.space_of[a] != self.space_of[b]:
                    pairs.append((a, b, common))
        return pairs

    def check_source(self, name: str, spec: FeatureSpec) -> None:
        """Raise ``AlignmentError`` unless ``spec`` (a stream's) is what source ``name``'s ids were laid out for,
        surfaces aside: another vocabulary would shift its ids into another source's range."""
        difference = spec_difference(_without_surfaces(self.source_specs[name]), _without_surfaces(spec))
        if difference:
            raise AlignmentError(f"source {name!r}: its stream has another FeatureSpec than the alignment was built for "
                                 f"({difference}); build the alignment from the streams' specs")
        # a source whose domain id is not stamped keeps its reader's surfaces: the union must count all of them
        built = self.source_specs[name].num_surfaces
        if self._plans[name].surface is None and spec.num_surfaces > built:
            raise AlignmentError(f"source {name!r}: its stream has {spec.num_surfaces} surfaces, the alignment was built for "
                                 f"{built} (its examples' surface ids would lie outside the union's); build the alignment "
                                 f"from the streams' specs or stamp the source's surface")

    def align(self, name: str, batch: Batch) -> Batch:
        """``batch`` of source ``name`` in the union spec (a new batch; ``batch`` is left as it was)."""
        return self.gather([(name, batch, 0, batch.batch_size)])

    def gather(self, segments: list[tuple[str, Batch | BatchView, int, int]]) -> Batch:
        """One union batch of rows ``[lo, hi)`` of each ``(source name, batch, lo, hi)``, in order (see
        ``gem_data.gathering``: slicing and re-keying in one pass). A batch read several times may come as its
        ``BatchView``, made once."""
        return gather_pieces(self._pieces(segments), self.spec)

    def gather_steps(self, steps: list[list[tuple[str, Batch | BatchView, int, int]]]) -> list[Batch]:
        """``[self.gather(segments) for segments in steps]``, the batches of several steps joined at once where they
        can be (see ``gem_data.gathering.gather_steps``)."""
        return gather_steps([self._pieces(segments) for segments in steps], self.spec)

    def _pieces(self, segments: list[tuple[str, Batch | BatchView, int, int]]) -> list[Piece]:
        views = [(name, batch if isinstance(batch, BatchView) else BatchView(batch), lo, hi) for name, batch, lo, hi in segments]
        if len(self.spaces) > 1:
            for name, view, _, _ in views:
                if view.batch.next_items is not None:
                    raise AlignmentError(f"source {name!r} has retrieval targets, which score against one item catalogue: "
                                         f"retrieval needs every source in one id space (the mixture has {list(self.spaces)})")
        return [Piece(self._plans[name], view, lo, hi) for name, view, lo, hi in views]


def _ordered(names) -> list[str]:
    """Distinct names in order of first appearance."""
    return list(dict.fromkeys(names))


def _without_surfaces(spec: FeatureSpec) -> FeatureSpec:
    return dataclasses.replace(spec, num_surfaces=1)
