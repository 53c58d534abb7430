"""Builders: turn the validated config into data streams, the sharded model, optimizers and the LR schedule."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gem_data import (
    AlignedRanking,
    AlignmentError,
    BatchSource,
    DataError,
    DomainExpertModel,
    FeatureAlignment,
    JoinedRanking,
    LengthBalancedStream,
    MixedStream,
    MixingConfig,
    MixSource,
    NextItemConfig,
    NextItemDataset,
    ParquetTable,
    SequenceCorpus,
    SurfaceFilterStream,
    SyntheticConfig,
    SyntheticGenerator,
    SyntheticStream,
    TableStream,
    TimeSplit,
    TimeSplitDataset,
    WorkerLoader,
    eval_batches,
    read_atomic,
    read_sequence_text,
    spec_difference,
    vocab_sizes,
)
from gem_kernels import Fp8Recipe, MXRecipe, convert_to_low_precision
from gem_kunlun import BaselineRanker, Batch, FeatureSpec, InterFormerModel, KunlunModel, SasrecModel
from gem_kunlun.event_personalization import check_event_names
from gem_parallel import (
    DenseOptions,
    LayoutError,
    ParallelDims,
    ParallelMeshes,
    TableWidthError,
    dense_parameters,
    init_dense_parameters,
    parallelize_kunlun,
    shard_embeddings,
)
from gem_trainer.config import ConfigError, PrecisionConfig, TrainerConfig
from gem_transfer import (
    DistilledStudent,
    RepresentationError,
    RepresentationJoin,
    RepresentationStore,
    SoftLabelError,
    SoftLabelStore,
    without_sparse_feature,
)
from gem_trainer.distributed import DistributedEnv
from gem_trainer.step import autocast_dtype


def build_generator(config: TrainerConfig) -> SyntheticGenerator:
    s = config.data.synthetic
    return SyntheticGenerator(
        SyntheticConfig(
            num_surfaces=s.num_surfaces,
            num_dense=s.num_dense,
            num_ads=s.num_ads,
            num_clusters=s.num_clusters,
            min_events=s.min_events,
            max_events=s.max_events,
            num_users=s.num_users,
            user_propensity=s.user_propensity,
            seed=config.seed if s.seed is None else s.seed,
        )
    )


@dataclass
class DataSetup:
    """What the trainer reads: the feature spec, this rank's resumable training stream, and either held-out
    batches for binary metrics (``eval_batches()``) or a next-item data set for ranking metrics."""

    spec: FeatureSpec
    train: BatchSource
    eval_batches: Callable[[], Iterator[Batch]] | None = None
    ranking: NextItemDataset | AlignedRanking | JoinedRanking | None = None
    mixer: MixedStream | None = None
    balancer: LengthBalancedStream | None = None
    surface_filter: SurfaceFilterStream | None = None
    # rows of one pass over the training data, all ranks together (None: an endless stream, synthetic or mixed)
    rows_per_epoch: int | None = None
    held_out: ParquetTable | None = None  # the held-out Parquet files eval_batches reads (their skipped rows count)


def build_data(config: TrainerConfig, env: DistributedEnv, representations: bool = True) -> DataSetup:
    """This rank's training stream and held-out data; with ``loopfm.store`` (and ``representations``) every
    batch, held-out ones too, carries its examples' LoopFM histories (the teacher's pass reads the data without)."""

    d = config.data
    # with balancing or a surface filter every rank reads the same global batches and keeps its share of them
    whole = d.balance or d.train_surfaces is not None
    rank, world, batch_size = (0, 1, d.batch_size * env.world_size) if whole else (env.rank, env.world_size, d.batch_size)
    mixer = ranking = eval_fn = rows_per_epoch = held_out = None
    if d.mixture.sources:
        mixer, ranking, eval_fn, held_out = _build_mixture(config, env, rank, world, batch_size)
        train = mixer
    elif d.source == "synthetic":
        generator = build_generator(config)
        train = SyntheticStream(generator, batch_size, rank, world)
        eval_fn = lambda: eval_batches(generator, d.batch_size, d.eval_batches, env.rank, env.world_size)  # noqa: E731
    elif d.source in ("sequence_text", "atomic"):
        ranking = build_next_item_dataset(config)
        _check_eval_split(config, ranking, "the data")
        train = TableStream(ranking.training_table(), batch_size, rank, world, shuffle=True, seed=config.seed,
                            read_rows=d.read_rows)
        rows_per_epoch = train.rows_per_epoch
    else:
        table = _nonempty(ParquetTable(_files(d.path, "*.parquet", "data.path"), skip_bad_rows=d.skip_bad_rows), d.path,
                          "data.path")
        held_out = _held_out_table(config, table, d.eval_path, "data.eval_path")
        train = TableStream(table, batch_size, rank, world, shuffle=True, seed=config.seed, read_rows=d.read_rows)
        rows_per_epoch = train.rows_per_epoch
        eval_fn = lambda: iter(TableStream(held_out, d.batch_size, env.rank, env.world_size, shuffle=False,  # noqa: E731
                                           num_epochs=1, read_rows=d.read_rows))
    if d.num_workers:
        train = WorkerLoader(train, num_workers=d.num_workers)
    surface_filter = None
    if d.train_surfaces is not None:
        try:
            surface_filter = train = SurfaceFilterStream(train, d.train_surfaces, env.rank, env.world_size)
        except ValueError as error:
            raise ConfigError(f"data.train_surfaces: {error}") from None
    balancer = None
    if d.balance:
        balancer = train = LengthBalancedStream(train, env.rank, env.world_size, window_batches=d.balance_window)
    if representations and config.solaris.student_input != "none":
        from gem_trainer.precompute import build_solaris_join

        if eval_fn is None:
            raise ConfigError("solaris.student_input needs held-out batches of (user, candidate) rows: synthetic or parquet data")
        # before LoopFM's join: the teacher that computes the pair embeddings reads the data as it trained
        train = build_solaris_join(config, env, train)
        eval_fn = _joined(train, eval_fn)
    if representations and config.loopfm.store is not None:
        # joined last, on this rank's own rows: the join depends on (user, time) only, so nothing before it changes
        train = build_representation_join(config, train, config.data.batch_size * env.world_size,
                                          planned_steps(config, rows_per_epoch, env.world_size))
        eval_fn = _joined(train, eval_fn)
        ranking = None if ranking is None else JoinedRanking(ranking, train.spec, train.attach)
    return DataSetup(train.spec, train, eval_fn, ranking, mixer, balancer, surface_filter, rows_per_epoch, held_out)


def resolve_schedule(config: TrainerConfig, data: DataSetup, env: DistributedEnv) -> TrainerConfig:
    """``config`` with ``schedule.steps`` decided by ``schedule.epochs`` (unchanged without it): enough global
    batches of ``data.batch_size x ranks`` examples to pass ``epochs`` times over ``data``'s training rows, the
    last batch possibly straddling into the next pass."""
    from gem_trainer.config import with_schedule_steps

    s = config.schedule
    if s.epochs is None:
        return config
    steps = planned_steps(config, data.rows_per_epoch, env.world_size)
    if s.warmup_steps >= steps:
        raise ConfigError(f"schedule.warmup_steps ({s.warmup_steps}) must be below the {steps} steps of schedule.epochs "
                          f"({s.epochs:g} passes over {data.rows_per_epoch:,} rows)")
    return with_schedule_steps(config, steps)


def planned_steps(config: TrainerConfig, rows_per_epoch: int | None, world_size: int) -> int:
    """The steps the run trains: ``schedule.steps``, or with ``schedule.epochs`` enough global batches of
    ``data.batch_size x world_size`` examples to pass that many times over ``rows_per_epoch`` training rows."""
    s = config.schedule
    if s.epochs is None:
        return s.steps
    if rows_per_epoch is None:
        raise ConfigError("schedule.epochs needs a finite data set, but this run's training stream is endless: set schedule.steps")
    # NOTE: the same in every case of build_data: with balancing or a surface filter each rank reads whole global
    # batches of this size and keeps its share
    return math.ceil(s.epochs * rows_per_epoch / (config.data.batch_size * world_size))


def rank_batch_bound(config: TrainerConfig) -> int:
    """The most examples one rank's share of a training step can hold: every stream of ``build_data`` gives a
    rank at most ``data.batch_size`` examples a step (filters and the end of a finite stream give fewer), except
    that length balancing moves examples between the steps of its window."""
    d = config.data
    return d.batch_size * (d.balance_window if d.balance else 1)


def global_batch_bound(config: TrainerConfig, env: DistributedEnv) -> int:
    """The most examples one training step's global batch can hold (every rank's share at its bound)."""
    return rank_batch_bound(config) * env.world_size


def moe_rows_per_example(config: TrainerConfig) -> int:
    """The rows an example gives each MoE of the trunk in a training step: two with a contrastive weight (the trunk
    runs on two views of every example), else one."""
    return 2 if config.model.name == "kunlun" and config.model.kunlun.build().contrastive_weight > 0 else 1


def _joined(join, eval_batches: Callable[[], Iterator[Batch]] | None) -> Callable[[], Iterator[Batch]] | None:
    """The held-out batches with ``join``'s feature attached, as the training stream has it."""
    return None if eval_batches is None else lambda: (join.attach(b) for b in eval_batches())


def teacher_spec(spec: FeatureSpec) -> FeatureSpec:
    """The features a teacher reads: the data's without the student's representation inputs (LoopFM, Solaris),
    which teachers are trained without and their passes (soft labels, representations) read the data without."""
    return dataclasses.replace(spec, representations=())


def model_spec(config: TrainerConfig, spec: FeatureSpec) -> FeatureSpec:
    """The features the models read of data with ``spec``: without LoopFM's user feature where it is a key only."""
    loop = config.loopfm
    return without_sparse_feature(spec, loop.user_feature) if loop.store is not None and loop.key_only else spec


def user_feature_missing(name: str, spec: FeatureSpec) -> str:
    """The one line saying the data has no user feature ``name``, and where each data source has one."""
    return (f"user feature {name!r} is not among the data's sparse features {[f.name for f in spec.sparse]} (synthetic data "
            f"has user ids with data.synthetic.num_users, next-item data with data.sequential.with_user_id = true)")


# data settings that choose neither the examples a pass over the data reads nor their order: how many a step reads,
# how they are read, and the held-out data (the batch size: where the examples do not follow it, see
# examples_follow_global_batch)
PASS_INDEPENDENT_DATA = ("batch_size", "eval_batches", "eval_path", "num_workers", "read_ahead", "read_ahead_switch_ms",
                         "read_ahead_process", "read_rows", "sequential.eval_split", "sequential.eval_protocols",
                         "sequential.eval_negatives", "sequential.eval_seeds", "sequential.eval_users",
                         "sequential.eval_chunk", "mixture.eval_source")


def examples_follow_global_batch(config: TrainerConfig) -> bool:
    """Whether the examples a pass over ``config``'s data reads change with the global batch size: synthetic data draws
    each global batch whole (from a seed per batch), and a mixture draws each global batch's sources."""
    return "synthetic" in config.data.readers() or bool(config.data.mixture.sources)


def pass_difference(config: TrainerConfig, meta: dict, global_batch: int) -> str | None:
    """How ``config``'s data, read in global batches of ``global_batch``, differs from the data a teacher's pass
    recorded in ``meta`` (its ``data`` section, the ``seed``, which draws synthetic data and orders every stream, and
    its ``global_batch_size``): ``"field: recorded -> this run's"`` for the first setting that differs, None where the
    pass read this run's examples."""
    from gem_trainer.run_folder import flatten

    def settings(seed, data: dict) -> dict:
        flat = {f"data.{name}": value for name, value in flatten(data).items()}
        return {"seed": seed, **{k: v for k, v in flat.items() if k.removeprefix("data.") not in PASS_INDEPENDENT_DATA}}

    before, after = settings(meta.get("seed"), meta.get("data") or {}), settings(config.seed, config.data.model_dump(mode="json"))
    changed = sorted(key for key in set(before) | set(after) if before.get(key) != after.get(key))
    if changed:
        return f"{changed[0]}: {before.get(changed[0])!r} -> {after.get(changed[0])!r}"
    if examples_follow_global_batch(config) and meta.get("global_batch_size") != global_batch:
        return f"global batch size (data.batch_size x ranks): {meta.get('global_batch_size')!r} -> {global_batch!r}"
    return None


def build_representation_join(config: TrainerConfig, source: BatchSource, global_batch: int,
                              steps: int) -> RepresentationJoin:
    """``source`` with LoopFM's histories from ``loopfm.store``, checked against the data: the store must have
    been written over data with the same features (its user ids are this data's), and over at least the examples
    this run trains on (``steps`` global batches of ``global_batch``; ``planned_steps``): past what the teacher's pass
    covered, the histories would stop at its last example without a word (as soft labels, refused)."""
    from gem_trainer.run_folder import spec_record

    loop = config.loopfm
    try:
        if loop.user_feature not in {f.name for f in source.spec.sparse}:
            raise RepresentationError(user_feature_missing(loop.user_feature, source.spec))
        store = RepresentationStore(loop.store)
        # NOTE: the store was written over the data without representation inputs (posttrain reads it so, and
        # without the user feature where it is a key only); the Solaris join, which runs before this one, adds its
        # own feature to the spec
        if store.meta.get("spec") != spec_record(teacher_spec(model_spec(config, source.spec))):
            raise RepresentationError(f"{loop.store} was written over data with other features than this run's")
        if store.meta.get("user_feature") != loop.user_feature:
            raise RepresentationError(f"{loop.store} is keyed by user feature {store.meta.get('user_feature')!r}, "
                                      f"loopfm.user_feature is {loop.user_feature!r}")
        # the vectors' settings: the run records loopfm's, and a resume is judged on them
        for key in ("dim", "layer", "projection_seed"):
            if store.meta.get(key) != getattr(loop, key):
                raise RepresentationError(f"{loop.store} holds vectors of {key} {store.meta.get(key)!r}, loopfm.{key} is "
                                          f"{getattr(loop, key)!r}")
        # NOTE: a user's history is the teacher's pass over this run's data: another data set's users share the ids
        difference = pass_difference(config, store.meta, global_batch)
        if difference is not None:
            raise RepresentationError(f"{loop.store} was written over other data than this run's ({difference}): run "
                                      f"posttrain with this config")
        covered, trained = store.steps * int(store.meta.get("global_batch_size", 0)), steps * global_batch
        if covered < trained:
            raise RepresentationError(f"{loop.store} holds the teacher's pass over {covered} examples ({store.steps} steps), "
                                      f"this run trains on {trained} ({steps} steps x data.batch_size x ranks): run "
                                      f"posttrain with this config")
        return RepresentationJoin(source, store, loop.user_feature, loop.max_events, key_only=loop.key_only)
    except RepresentationError as error:
        raise ConfigError(f"loopfm.store: {error}") from None


def _build_mixture(config: TrainerConfig, env: DistributedEnv, rank: int, world: int, batch_size: int):
    """The mixed training stream of ``[data.mixture]`` (every source read in place, aligned into one union
    spec), and the held-out data of its evaluation source: ``(mixer, ranking data set, eval batches, held-out Parquet
    table)``."""

    d, m = config.data, config.data.mixture
    corpora: dict[tuple[str, str], SequenceCorpus] = {}
    streams, datasets, tables, id_spaces, generator = {}, {}, {}, {}, None
    for s in m.sources:
        reader, path = s.reader or d.source, s.path or d.path
        # NOTE: sources reading the same data share its ids unless told otherwise; other sources get their own
        id_spaces[s.name] = s.id_space if s.id_space is not None else f"<{reader}:{Path(path).resolve() if path else ''}>"
        if reader == "synthetic":
            generator = generator or build_generator(config)
            # a synthetic batch is one draw: its size must not depend on the number of ranks
            streams[s.name] = SyntheticStream(generator, d.batch_size * env.world_size, stream=s.seed)
            continue
        if reader in ("sequence_text", "atomic"):
            datasets[s.name] = build_next_item_dataset(config, s, corpora)
            table = datasets[s.name].training_table()
        else:
            field = _path_field(s, "path")
            table = tables[s.name] = _nonempty(ParquetTable(_files(path, "*.parquet", field), skip_bad_rows=d.skip_bad_rows),
                                               path, field)
        # an online source is its stream in time order, read once (check_mixture_reads); offline logs are shuffled,
        # pass after pass
        streams[s.name] = TableStream(table, d.batch_size, shuffle=not s.online, seed=config.seed, read_rows=d.read_rows,
                                      num_epochs=1 if s.online else None)
    # NOTE: each table's times count from its own earliest event; a per-user memory (LoopFM, Solaris) compares times
    # across sources, so every table of the mixture (and the held-out files, read with its base) takes one clock
    if tables:
        base = min(table.time_base for table in tables.values())
        for table in tables.values():
            table.rebase(base)
    try:
        alignment = FeatureAlignment({n: stream.spec for n, stream in streams.items()}, id_spaces,
                                     {s.name: s.surface for s in m.sources})
    except AlignmentError as error:
        raise ConfigError(f"data.mixture.sources: {error}") from None
    if len(alignment.spaces) > 1:
        catalogue_model = config.model.name == "sasrec" or (config.model.name == "kunlun" and config.model.kunlun.two_tower)
        if d.sequential.objective == "retrieval" or catalogue_model:
            raise ConfigError(f"data.mixture.sources: retrieval and two-tower / SASRec models score against one item "
                              f"catalogue, but the sources lie in {len(alignment.spaces)} id spaces; give them one id_space "
                              f"or use the pointwise objective with a crossing model")
    mixing = MixingConfig(
        sources=tuple(MixSource(s.name, s.weight, s.online) for s in m.sources), batch_size=batch_size,
        granularity=m.granularity, online_share_start=m.online_share_start, online_share_end=m.online_share_end,
        ramp_start=m.ramp_start, ramp_steps=m.ramp_steps, seed=config.seed,
    )
    mixer = MixedStream(streams, mixing, rank, world, alignment)
    name = m.evaluated
    ranking = eval_fn = held_out = None
    if name in datasets:
        _check_eval_split(config, datasets[name], f"the evaluated source {name!r}")
        ranking = AlignedRanking(datasets[name], alignment, name)
    elif name in tables:
        evaluated = next(s for s in m.sources if s.name == name)
        held_out = _held_out_table(config, tables[name], evaluated.eval_path or d.eval_path, _path_field(evaluated, "eval_path"))
        eval_fn = lambda: (alignment.align(name, b) for b in  # noqa: E731
                           TableStream(held_out, d.batch_size, env.rank, env.world_size, shuffle=False, num_epochs=1,
                                       read_rows=d.read_rows))
    else:
        eval_fn = lambda: (alignment.align(name, b) for b in  # noqa: E731
                           eval_batches(generator, d.batch_size, d.eval_batches, env.rank, env.world_size))
    return mixer, ranking, eval_fn, held_out


def _check_eval_split(config: TrainerConfig, dataset: NextItemDataset, what: str) -> None:
    """Refuse an evaluation split that ``dataset`` (``what`` it is, for the message) cannot give: a period of the time
    split from data without event times (not split), or the leave-one-out targets of a time split's periods (their
    training targets include them)."""

    split, split_data = config.data.sequential.eval_split, isinstance(dataset, TimeSplitDataset)
    if split in ("next_period", "offline_period") and not split_data:
        raise ConfigError(f"data.sequential.eval_split = \"{split}\" evaluates a period of the time split, and {what} has "
                          f"no event times (it is not split): evaluate \"valid\" or \"test\"")
    if split in ("valid", "test") and split_data:
        raise ConfigError(f"data.sequential.eval_split = \"{split}\": {what} trains on periods of data.sequential.time_split, "
                          f"which hold the leave-one-out targets; evaluate \"next_period\" or \"offline_period\"")


def check_mixture_reads(config: TrainerConfig, data: DataSetup) -> None:
    """Refuse a schedule that reads a mixture's online source past its end: the stream is read once, in time order,
    and the draws of every step are known before training (replaying it from its start would train on the online
    period again, out of time order)."""

    if data.mixer is None:
        return
    m, steps = config.data.mixture, config.schedule.steps
    if m.online_share_end is not None and m.ramp_start >= steps:
        # the schedule's ramp would silently not happen: the run ends before it starts
        raise ConfigError(f"data.mixture.ramp_start ({m.ramp_start:,}) is at or past schedule.steps ({steps:,}): the online "
                          f"share stays {m.online_share_start} for the whole run and never moves to {m.online_share_end}: "
                          f"start the ramp earlier, train longer, or drop online_share_end for a constant share")
    short = data.mixer.short_sources(config.schedule.steps)
    if short:
        name, read, held, step = short[0]
        raise ConfigError(f"data.mixture.sources.{name}: its stream holds {held:,} examples, read once in time order, and "
                          f"schedule.steps = {config.schedule.steps:,} would read {read:,} of it (it runs out at step "
                          f"{step + 1:,}): train fewer steps or give it a smaller share")


def _held_out_table(config: TrainerConfig, table: ParquetTable, eval_path: str, field: str) -> ParquetTable:
    """The held-out Parquet files (``eval_path``, set by config field ``field``), read with the training table's
    vocabularies, surfaces and time base; files whose columns differ from the training data's are refused (labels
    are matched by position: another order would score one task's predictions against another's labels)."""
    held_out = _nonempty(ParquetTable(_files(eval_path, "*.parquet", field), skip_bad_rows=config.data.skip_bad_rows,
                                      vocab_sizes=vocab_sizes(table.spec),
                                      num_surfaces=table.spec.num_surfaces, time_base=table.time_base), eval_path, field)
    difference = spec_difference(table.spec, held_out.spec)
    if difference is not None:
        raise DataError(eval_path, None, f"{field}: the held-out data's columns differ from the training data's "
                                         f"({difference})")
    return held_out


def build_next_item_dataset(config: TrainerConfig, source=None, corpora: dict | None = None) -> NextItemDataset:
    """Read a sequence file (with its item attributes) or RecBole atomic files into the next-item task: of
    ``data`` or of mixture ``source`` (its reader and path); ``corpora`` shares files read by several sources.
    With ``data.sequential.time_split`` the examples are one period of the split: a mixture's online source the
    online period, an offline one the offline period, a lone source both; a mixture's offline source whose events
    carry no times (a sequence file, atomic files without a timestamp) is not split: all its examples train."""
    d, s = config.data, config.data.sequential
    reader = source.reader if source is not None and source.reader else d.source
    path = Path(source.path if source is not None and source.path else d.path)
    key = (reader, str(path.resolve()))
    corpus = corpora.get(key) if corpora is not None else None
    if corpus is None:
        corpus = _read_corpus(config, reader, path, "data.path" if source is None else _path_field(source, "path"))
        if corpora is not None:
            corpora[key] = corpus
    next_item = NextItemConfig(
        num_negatives=s.num_negatives, objective=s.objective, queries=s.queries, loss=s.loss,
        sampler=s.sampler, popularity_power=s.popularity_power,
        max_history=s.max_history, attribute_slots=s.attribute_slots, with_user_id=s.with_user_id, seed=config.seed,
    )
    where = "data" if source is None else f"data.mixture.sources.{source.name}"
    if s.time_split is not None and not corpus.timed and (source is None or source.online):
        role = "the data" if source is None else "an online source"
        raise DataError(path, None, f"{where}: data.sequential.time_split cuts {role} at event times, and this {reader} "
                                    f"data has none (its events are in file order)")
    if s.time_split is None or not corpus.timed:
        dataset = NextItemDataset(corpus, next_item)
        if not dataset.num_training_examples:
            short = int((corpus.lengths() < 4).sum())
            raise DataError(path, None, f"no training examples: a user trains on the items before the last two (kept to "
                                        f"validate and test), and {short} of its {corpus.num_users} users have 3 items or fewer")
        return dataset
    period = "before_next" if source is None else ("online" if source.online else "offline")
    dataset = TimeSplitDataset(corpus, next_item, TimeSplit(*s.time_split), period)
    if not dataset.num_training_examples:
        raise DataError(path, None, f"no training examples in the {period} period of data.sequential.time_split = {list(s.time_split)}")
    return dataset


def _nonempty(table: ParquetTable, path: str, field: str) -> ParquetTable:
    """``table``, unless it holds no rows (read from ``path``, set by config field ``field``): a one-line error."""
    if not table.num_rows:
        skipped = f" ({table.bad_rows} bad rows skipped)" if table.bad_rows else ""
        raise DataError(path, None, f"{field}: no rows{skipped}")
    return table


def _path_field(source, name: str) -> str:
    """The config field that gave mixture ``source`` its ``path`` or ``eval_path``: its own, or data's default."""
    return f"data.mixture.sources.{source.name}.{name}" if getattr(source, name) else f"data.{name}"


def _read_corpus(config: TrainerConfig, reader: str, path: Path, field: str) -> SequenceCorpus:
    """The corpus of a sequence file or of atomic files at ``path``, set by config field ``field``."""
    d, s = config.data, config.data.sequential
    if reader == "sequence_text":
        text = path if path.is_file() else _single(path, "*.txt", field)
        if s.attributes_file and not Path(s.attributes_file).is_file():
            what = "is a folder, not a file" if Path(s.attributes_file).is_dir() else "does not exist"
            raise FileNotFoundError(f"data.sequential.attributes_file: {s.attributes_file} {what}")
        # without one given, the attributes file beside the sequences is read where it exists
        attributes = Path(s.attributes_file) if s.attributes_file else text.with_name(f"{text.stem}_item2attributes.json")
        return read_sequence_text(text, attributes if attributes.is_file() else None, skip_bad_rows=d.skip_bad_rows)
    if not path.exists():
        raise FileNotFoundError(f"{field}: {path} does not exist")
    if not path.is_dir():
        hint = f": give its folder, {path.parent}" if path.suffix == ".inter" else ""
        raise FileNotFoundError(f"{field}: {path} is not a folder of atomic files{hint}")
    return read_atomic(path, skip_bad_rows=d.skip_bad_rows)


def _single(folder: Path, pattern: str, field: str) -> Path:
    if not folder.is_dir():
        raise FileNotFoundError(f"{field}: {folder} does not exist")
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise FileNotFoundError(f"{field}: expected one {pattern} file in {folder}, found {[f.name for f in found]}")
    return found[0]


def _files(path: str, pattern: str, field: str) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob(pattern)) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"{field}: no {pattern} file at {p}")
    return files


def _kunlun(m, spec: FeatureSpec, device) -> nn.Module:
    model_config = m.kunlun.build()
    check_event_names(model_config.events, spec, field="model.kunlun.events")
    return KunlunModel(spec, model_config, device=device)


# model.name -> its builder (the model section -> the unsharded model): one entry per model family
MODELS: dict[str, Callable[..., nn.Module]] = {
    "kunlun": _kunlun,
    "interformer": lambda m, spec, device: InterFormerModel(spec, m.interformer.build(), device=device),
    "domain_experts": lambda m, spec, device: DomainExpertModel(spec, m.kunlun.build(), m.domain_experts.num_shared,
                                                                m.domain_experts.num_specific, device=device),
    "sasrec": lambda m, spec, device: SasrecModel(spec, m.sasrec.build(), device=device),
    "baseline": lambda m, spec, device: BaselineRanker(spec, m.baseline.build(), device=device),
}


def build_model(config: TrainerConfig, spec: FeatureSpec, device: torch.device | None = None) -> nn.Module:
    """The unsharded model of ``config.model.name``; built on ``device`` (the meta device: no allocation)."""
    return MODELS[config.model.name](config.model, spec, device)


def build_student(config: TrainerConfig, model: nn.Module) -> nn.Module:
    """With a teacher configured, wrap ``model`` with the auxiliary head and student adapter of distillation."""
    d = config.distillation
    if d.teacher_run_dir is None and d.soft_labels is None:
        return model
    retrieval = config.data.source in ("sequence_text", "atomic") and config.data.sequential.objective == "retrieval"
    return DistilledStudent(
        model, model.representation_dim, len(model.spec.tasks), model.spec.num_surfaces, weight=d.weight,
        temperature=d.temperature, adapter=d.adapter, retrieval=retrieval, device=next(model.parameters()).device,
    )


def build_teacher(config: TrainerConfig, spec: FeatureSpec, env: DistributedEnv) -> tuple[nn.Module, nn.Module] | None:
    """The teacher of distillation, sharded like a trained model and loaded from its checkpoint (``teacher_step``:
    pin it first with ``pin_teacher_step`` where the step is recorded), with its unsharded twin (which answers FLOP
    questions)."""
    import torch.distributed.checkpoint as dcp

    from gem_trainer.checkpoint import CheckpointManager
    from gem_trainer.config import ConfigError, load_config
    from gem_trainer.run_folder import spec_record, stored_spec

    folder = config.distillation.teacher_run_dir
    if folder is None:
        return None
    step = teacher_step(config)
    teacher_config = load_config(Path(folder) / "config.toml")
    spec = teacher_spec(spec)
    # the teacher's features come from its run folder; only a run older than spec.json reads its data again
    recorded = stored_spec(folder)
    same = recorded == spec_record(spec) if recorded is not None else build_data(teacher_config, env, representations=False).spec == spec
    if not same:
        raise ConfigError(f"distillation.teacher_run_dir: the teacher at {folder} was trained on other features than this run")
    checkpoints = CheckpointManager(Path(folder) / "checkpoints", keep_latest=1)
    unsharded = build_model(teacher_config, spec, device=torch.device("meta"))
    # the teacher only runs forward: tables sharded as this run shards its own (the teacher's layout may need other
    # devices; the checkpoint loads into any), the dense part replicated on every rank, then loaded
    try:
        teacher = shard_embeddings(unsharded, env.device, sharding_type=config.parallelism.sparse_sharding)
    except LayoutError as error:
        raise ConfigError(f"distillation.teacher_run_dir: the teacher's tables: parallelism.{error}") from None
    init_dense_parameters(unsharded, teacher_config.seed, env.device)
    state = {"model": teacher.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoints.path(step)))
    teacher.load_state_dict(state["model"])
    # frozen: it only ever runs under no_grad, in eval mode (one view of each example), as its FLOPs are counted
    return teacher.eval(), unsharded.eval()


def teacher_step(config: TrainerConfig) -> int:
    """The teacher's checkpoint step: ``distillation.teacher_step``, else its run's newest."""
    from gem_trainer.checkpoint import CheckpointManager

    d = config.distillation
    record = Path(d.teacher_run_dir) / "config.toml"
    if not record.is_file():
        raise ConfigError(f"distillation.teacher_run_dir: {record} not found (is {d.teacher_run_dir} a finished run folder?)")
    checkpoints = CheckpointManager(Path(d.teacher_run_dir) / "checkpoints", keep_latest=1)
    complete = checkpoints.complete_steps()
    if d.teacher_step is None:
        if not complete:
            raise ConfigError(f"distillation.teacher_run_dir: no complete checkpoint under {checkpoints.folder}")
        return complete[-1]
    if d.teacher_step not in complete:
        raise ConfigError(f"distillation.teacher_step: no complete checkpoint {d.teacher_step} under {checkpoints.folder} "
                          f"(complete: {complete or 'none'})")
    return d.teacher_step


def with_teacher_step(config: TrainerConfig) -> TrainerConfig:
    """``config`` with its online teacher's checkpoint pinned (``distillation.teacher_step``): as given, else the one
    its run recorded when resuming it (a resumed student keeps its teacher, which may have trained on since), else
    the teacher's newest."""
    from gem_trainer.checkpoint import CheckpointManager
    from gem_trainer.config import load_config

    d = config.distillation
    step = d.teacher_step
    record = Path(config.run_dir) / "config.toml"
    resumes = config.checkpoint.enable and config.checkpoint.resume and \
        CheckpointManager(Path(config.run_dir) / "checkpoints", keep_latest=1).complete_steps()
    if step is None and resumes and record.is_file():
        recorded = load_config(record).distillation
        if recorded.teacher_run_dir is not None and Path(recorded.teacher_run_dir).resolve() == Path(d.teacher_run_dir).resolve():
            step = recorded.teacher_step
    return pin_teacher_step(config.model_copy(update={"distillation": d.model_copy(update={"teacher_step": step})}))


def pin_teacher_step(config: TrainerConfig) -> TrainerConfig:
    """``config`` with ``distillation.teacher_step`` set to the checkpoint ``teacher_step`` picks, the same on every
    rank (rank 0's pick).

    NOTE: a teacher still training writes new checkpoints: asking for its newest twice (to load it, then to record
    it) or on each rank could give two steps, a store recording another teacher than the one that wrote it, or ranks
    loading different teachers."""
    import torch.distributed as dist

    step = teacher_step(config)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        agreed = [step]
        dist.broadcast_object_list(agreed, src=0)
        step = agreed[0]
    d = config.distillation
    return config.model_copy(update={"distillation": d.model_copy(update={"teacher_step": step})})


def apply_low_precision(config: TrainerConfig, model: nn.Module) -> list[str]:
    """``precision.low_precision``: the model's GEMMs outside ``precision.high_precision`` switched to FP8 or
    emulated MXFP8 in place; ``precision.fp8_attention``: its local self-attention layers outside it to FP8 Q, K, V.
    Returns the converted module names (none when both are off)."""
    from gem_kunlun.local_attention import LocalAttention

    p = config.precision
    kept = set(p.high_precision)

    def keep(name: str) -> bool:
        return any(part in kept for part in name.split("."))

    if p.low_precision != "off" or p.fp8_attention:
        # NOTE: a name of no module keeps nothing: a misspelt one would leave its layer in low precision without a
        # word (the defaults name parts of several models and what distillation adds, so they may match nothing)
        parts = {part for name, _ in model.named_modules() for part in name.split(".")}
        unknown = sorted(kept - parts - set(PrecisionConfig.model_fields["high_precision"].default))
        if unknown:
            raise ConfigError(f"precision.high_precision: {unknown[0]!r} is no part of a module name of this model (e.g. "
                              f"{', '.join(sorted(n for n in parts if n and not n.isdigit())[:8])})")

    converted = []
    if p.fp8_attention:
        for name, module in model.named_modules():
            if isinstance(module, LocalAttention) and not keep(name):
                module.fp8 = True
                converted.append(name)
    if p.low_precision == "off":
        return converted
    if p.low_precision == "fp8":
        recipe = Fp8Recipe(weight_gradient=p.fp8_weight_gradient, scaling=p.fp8_scaling, min_features=p.fp8_min_features,
                           min_tokens=p.fp8_min_tokens)
    else:
        recipe = MXRecipe(elem=p.mx_elem, grad_elem=p.mx_grad_elem, rounding=p.mx_rounding)
    return converted + convert_to_low_precision(model, recipe, keep=keep)


def build_soft_labels(config: TrainerConfig, spec: FeatureSpec, env: DistributedEnv) -> SoftLabelStore | None:
    """The store of offline distillation (None unless ``distillation.soft_labels``), checked against this run:
    the same features, global batch size and at least ``schedule.steps`` steps."""
    from gem_trainer.run_folder import spec_record

    folder = config.distillation.soft_labels
    if folder is None:
        return None
    try:
        store = SoftLabelStore(folder)
    except SoftLabelError as error:
        raise ConfigError(f"distillation.soft_labels: {error}") from None
    meta, global_batch = store.meta, config.data.batch_size * env.world_size
    if meta.get("spec") != spec_record(teacher_spec(spec)):
        raise ConfigError(f"distillation.soft_labels: {folder} was written for other features than this run's data")
    if meta.get("global_batch_size") != global_batch:
        raise ConfigError(f"distillation.soft_labels: {folder} was written with global batches of {meta.get('global_batch_size')} "
                          f"examples, this run reads {global_batch} (data.batch_size x ranks)")
    if store.steps < config.schedule.steps:
        raise ConfigError(f"distillation.soft_labels: {folder} holds {store.steps} steps, schedule.steps is "
                          f"{config.schedule.steps}: run posttrain with this config")
    # the run's distillation settings name what it trains on: where given, they must be the store's (the store
    # decides, and a run naming another teacher or checkpoint would record one it never learnt from)
    d, written = config.distillation, meta.get("teacher") or {}
    if d.teacher_run_dir is not None and (written.get("run_dir") is None
                                          or Path(written["run_dir"]).resolve() != Path(d.teacher_run_dir).resolve()):
        raise ConfigError(f"distillation.soft_labels: {folder} was written by the teacher at {written.get('run_dir')}, "
                          f"distillation.teacher_run_dir is {d.teacher_run_dir}")
    if d.teacher_step is not None and written.get("step") != d.teacher_step:
        raise ConfigError(f"distillation.soft_labels: {folder} holds the logits of the teacher's checkpoint "
                          f"{written.get('step')}, distillation.teacher_step is {d.teacher_step}")
    if d.top_k is not None and meta.get("top_k") != d.top_k + d.tail_samples:
        held = "every candidate's logit" if meta.get("top_k") is None else f"{meta.get('top_k')} items per query"
        raise ConfigError(f"distillation.soft_labels: {folder} holds {held}, distillation.top_k + tail_samples is "
                          f"{d.top_k + d.tail_samples}")
    return store


def task_weights(config: TrainerConfig, spec: FeatureSpec) -> torch.Tensor:
    unknown = sorted(set(config.model.task_weights) - set(spec.tasks))
    if unknown:
        raise ConfigError(f"model.task_weights names unknown tasks {unknown}; the data has {list(spec.tasks)}")
    weights = [config.model.task_weights.get(t, 1.0) for t in spec.tasks]
    if not any(weights):
        raise ConfigError(f"model.task_weights gives every task ({list(spec.tasks)}) weight 0: the loss would be zero")
    return torch.tensor(weights)


def build_parallel_dims(config: TrainerConfig, env: DistributedEnv) -> ParallelDims:
    """The layout of ``[parallelism]`` on this job's ranks; a bad degree is a one-line ``ConfigError``."""

    p = config.parallelism
    try:
        dims = ParallelDims(world_size=env.world_size, local_world_size=env.local_world_size, dense_replicate=p.dense_replicate,
                            dense_shard=p.dense_shard, expert=p.expert, sparse_group=p.sparse_group)
    except LayoutError as error:
        raise ConfigError(f"parallelism.{error}") from None
    if p.sparse_sync_every != 1 and not dims.sparse_2d:
        raise ConfigError(f"parallelism.sparse_sync_every averages the table replicas of 2-D sparse parallelism, which this "
                          f"run has none of: it needs a sparse_group below the {env.world_size} ranks")
    return dims


def cuda_graphs(config: TrainerConfig, device: torch.device, world_size: int) -> bool:
    """``parallelism.cuda_graphs``: "auto" replays the layers' fixed-shape parts as CUDA graphs where they can be:
    on a GPU, in one process without FSDP mixed precision, with no part compiled (a graph cannot hold a collective,
    and a compiled part brings its own), without activation checkpointing (a recomputed forward), and with MoEs
    that have a capacity (without one, a MoE sizes its rows by a count read on the host)."""
    p = config.parallelism
    if p.cuda_graphs != "auto":
        return p.cuda_graphs == "on"
    return (device.type == "cuda" and world_size == 1 and p.compile == "off" and p.compile_experts != "on"
            and not p.activation_checkpointing and p.param_dtype == p.reduce_dtype == "float32"
            and config.model.kunlun.build().capacity_factor > 0)


def compile_experts(config: TrainerConfig, device: torch.device, world_size: int) -> bool:
    """``parallelism.compile_experts``: "auto" compiles each MoE on a GPU, in one process without FSDP mixed
    precision, where blocks are not compiled and layers not replayed as CUDA graphs (an eager MoE is a few
    hundred small kernels a step)."""
    p = config.parallelism
    if p.compile_experts != "auto":
        return p.compile_experts == "on"
    return (not cuda_graphs(config, device, world_size) and device.type == "cuda" and world_size == 1
            and p.compile == "off" and p.param_dtype == p.reduce_dtype == "float32")


def sequence_lookup_dtype(config: TrainerConfig, device: torch.device) -> torch.dtype | None:
    """The dtype the sequence tables' lookups return on GPUs: autocast's where every reader of the looked-up event
    vectors computes in it (a Kunlun history whose residual stream is in autocast's dtype, KunlunConfig's default,
    without an item tower that pools the same tables' vectors), float32 (None) otherwise."""
    m = config.model
    dtype = autocast_dtype(config.precision.autocast, device)
    if dtype is None or device.type != "cuda" or m.name not in ("kunlun", "domain_experts"):
        return None
    kunlun = m.kunlun.build()
    return None if kunlun.fp32_residual or kunlun.share_item_table else dtype


def parallelize_model(config: TrainerConfig, model: nn.Module, dims: ParallelDims, meshes: ParallelMeshes,
                      env: DistributedEnv) -> nn.Module:
    """Shard the embedding tables (row-wise Adagrad fused into their backward), split the experts, initialise
    and FSDP-wrap the dense part, as ``gem_parallel.parallelize_kunlun`` orders it."""
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.optim import RowWiseAdagrad


    o = config.optimizer
    sparse_optimizer, sparse_kwargs = (RowWiseAdagrad, {"lr": o.sparse_lr, "eps": o.sparse_eps}) if o.sparse == "rowwise_adagrad" \
        else (torch.optim.SGD, {"lr": o.sparse_lr})
    p, dtypes = config.parallelism, {"float32": None, "bfloat16": torch.bfloat16}
    dense = DenseOptions(param_dtype=dtypes[p.param_dtype], reduce_dtype=dtypes[p.reduce_dtype],
                         reshard_after_forward=p.reshard_after_forward,
                         activation_checkpointing=p.activation_checkpointing, compile=p.compile,
                         compile_experts=compile_experts(config, env.device, dims.world_size),
                         cuda_graphs=cuda_graphs(config, env.device, dims.world_size),
                         history_bucket=p.cuda_graph_history_bucket)
    try:
        return parallelize_kunlun(
            model, dims, meshes, env.device, seed=config.seed, dense=dense, sparse_sharding=p.sparse_sharding,
            sparse_optimizer=sparse_optimizer, sparse_optimizer_kwargs=sparse_kwargs, expert_padded=p.expert_padded,
            # the MoEs' bounds count the rows they receive
            global_batch_bound=global_batch_bound(config, env) * moe_rows_per_example(config),
            rank_batch_bound=rank_batch_bound(config) * moe_rows_per_example(config),
            sparse_index_dedup=p.sparse_index_dedup,
            sparse_sequence_dtype=sequence_lookup_dtype(config, env.device),
        )
    except LayoutError as error:
        raise ConfigError(f"parallelism.{error}") from None
    except TableWidthError as error:
        name = config.model.name
        width = {"baseline": "baseline.dim", "sasrec": "sasrec.dim", "interformer": "interformer.d_model"}.get(name, "kunlun.d_model")
        raise ConfigError(f"model: {error}: make model.{width} (or an event type's own width) a multiple of 4") from None
    except PlannerError as error:  # TorchRec's dozens of lines; the tables' sizes say what to change
        tables = sorted(((t.num_embeddings * t.embedding_dim, t.name, t.num_embeddings) for module in model.modules()
                         for t in [*getattr(module, "embedding_bag_configs", list)(), *getattr(module, "embedding_configs", list)()]),
                        reverse=True)
        largest = ", ".join(f"{name} ({rows:,} rows)" for _, name, rows in tables[:3])
        raise ConfigError(f"parallelism: the embedding tables fit no sharding plan ({str(error).splitlines()[0].strip()}); "
                          f"the largest: {largest}") from None


def build_optimizers(config: TrainerConfig, model: nn.Module):
    """Dense AdamW over every parameter not updated in backward, combined with TorchRec's fused sparse optimizer:
    ``(combined, dense, dense_adamw)`` (the dense one keyed, as checkpoints store it, and the torch AdamW inside it,
    which gradient clipping hands its factor to)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    o = config.optimizer
    params = dense_parameters(model)
    # NOTE: on GPUs the fused AdamW is one kernel for all parameters instead of several per parameter; the CPU
    # keeps the reference implementation
    fused = bool(params) and all(p.device.type == "cuda" for p in params.values())

    def adamw(tensors: list[torch.Tensor]) -> torch.optim.AdamW:
        if not fused:
            return torch.optim.AdamW(tensors, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        # NOTE: one fused call takes one kind of tensor: FSDP's DTensor shards and the parameters FSDP leaves
        # alone (empty ones, e.g. the projection of zero dense features) go in param groups of their own
        kinds = ([t for t in tensors if isinstance(t, DTensor)], [t for t in tensors if not isinstance(t, DTensor)])
        groups = [{"params": kind} for kind in kinds if kind]
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=True)

    dense_adamw = adamw(list(params.values()))
    dense = KeyedOptimizerWrapper(params, lambda tensors: dense_adamw)  # the wrapper hands it the same tensors
    combined = CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense)])
    return combined, dense, dense_adamw


def build_lr_scheduler(config: TrainerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak at the last warmup step (the first step without warmup), then cosine / linear decay
    that reaches ``min_lr_ratio`` at the last step (or constant)."""
    s = config.schedule
    peak = max(s.warmup_steps - 1, 0)

    def factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.decay == "constant":
            return 1.0
        progress = min(1.0, (step - peak) / max(1, s.steps - 1 - peak))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if s.decay == "cosine" else 1 - progress
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
