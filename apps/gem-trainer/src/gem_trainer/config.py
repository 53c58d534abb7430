"""The trainer's configuration: TOML files validated by pydantic, with inheritance and command-line overrides.

A file may name a ``base = "other.toml"`` (relative to itself) whose values it overrides, section by
section. ``--section.field=value`` arguments override the merged result; values are read as TOML
literals (``--optimizer.lr=3e-4``, ``--model.hidden=[64,32]``) and fall back to plain strings.
Every error is one line naming the file and the dotted path of the bad field.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from gem_data import READ_ROWS
from gem_kernels import Fp8Recipe
from gem_kunlun import KUNLUN_SIZES, BaselineConfig, InterFormerConfig, KunlunConfig, SasrecConfig
from gem_parallel.dense import COMPILE_MODES

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.toml"


class ConfigError(ValueError):
    """A configuration problem; ``str(error)`` is a single line naming the file and field."""


class Section(BaseModel):
    # NOTE: no field takes NaN or infinity (a NaN popularity power or mixture weight would pass every bound check)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def changed(self, *names: str) -> list[str]:
        """Those of ``names`` (default: every field) whose value is not their default: settings that must have
        something to apply to."""
        fields = type(self).model_fields
        return [name for name in names or fields if getattr(self, name) != fields[name].default]

    @model_validator(mode="before")
    @classmethod
    def _none_spelled_out(cls, data: Any) -> Any:
        """TOML has no null: ``"none"`` switches off an optional field (``--optimizer.grad_clip=none``)."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, field in cls.model_fields.items() if not field.is_required() and _allows_none(field.annotation)}
        return {k: (None if k in optional and isinstance(v, str) and v.lower() == "none" else v) for k, v in data.items()}

    @model_validator(mode="before")
    @classmethod
    def _no_converted_values(cls, data: Any) -> Any:
        """pydantic would take true / false for a number (1 / 0), and text for a number or a switch ("2" for 2, "yes"
        for true): a TOML boolean or string where a number belongs, or a string where a boolean does, is a mistake."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is None or (isinstance(value, str) and value.lower() == "none" and _allows_none(field.annotation)):
                    continue
                # NOTE: only text pydantic would convert; other text gets its own error, which names the field's path
                if (isinstance(value, bool) or (isinstance(value, str) and _numeric(value))) and _is_number(field.annotation):
                    raise ValueError(f"{name} takes a number, got {value!r}")
                if isinstance(value, (list, tuple)) and _is_numbers(field.annotation) and any(
                        isinstance(v, bool) or (isinstance(v, str) and _numeric(v)) for v in value):
                    raise ValueError(f"{name} takes numbers, got {list(value)!r}")
                if (isinstance(value, str) and value.strip().lower() in _SWITCH_WORDS
                        or isinstance(value, (int, float)) and not isinstance(value, bool)) and _is_switch(field.annotation):
                    raise ValueError(f"{name} takes true or false, got {value!r}")
        return data


def _kinds(annotation: Any) -> set:
    """The types a field's annotation allows besides None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation)) - {type(None)}
    return {annotation}


def _is_number(annotation: Any) -> bool:
    """Whether a field's annotation is a number (int or float, maybe optional), nothing else."""
    kinds = _kinds(annotation)
    return bool(kinds) and kinds <= {int, float}


# text pydantic reads as a boolean in its lax mode
_SWITCH_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n"}


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_numbers(annotation: Any) -> bool:
    """Whether a field's annotation is a tuple of numbers (maybe optional), nothing else."""
    kinds = _kinds(annotation)
    return len(kinds) == 1 and typing.get_origin(kind := next(iter(kinds))) is tuple and \
        set(typing.get_args(kind)) - {Ellipsis} <= {int, float}


def _is_switch(annotation: Any) -> bool:
    """Whether a field's annotation is a boolean (maybe optional), nothing else."""
    return _kinds(annotation) == {bool}


def _allows_none(annotation: Any) -> bool:
    return annotation is type(None) or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)
    )


class ConfigSection(Section):
    """A section generated from a gem-kunlun config dataclass by ``section_of``: ``build()`` returns the dataclass."""

    config_type: ClassVar[type]
    preset: ClassVar[dict[str, Any] | None] = None

    @model_validator(mode="after")
    def _checked(self) -> "ConfigSection":
        self.build()  # the model's own checks (heads divide width, known CompSkip components, ...)
        return self

    def build(self):
        values = {k: _built(v) for k, v in dict(self).items() if k != "size" and v is not None}
        if self.preset is None:
            return self.config_type(**values)
        return dataclasses.replace(self.preset[self.size], **values)


def section_of(config_type: type, preset: dict[str, Any] | None = None) -> type[ConfigSection]:
    """The config section of a gem-kunlun config dataclass, generated from its fields, so that every model
    field is declared once, in its model's package: types from the dataclass, checks in its
    ``__post_init__`` (run at validation). With ``preset`` (name -> instance) the section gains a ``size``
    field choosing the preset, and every other field defaults to "the preset's" (None)."""
    hints = typing.get_type_hints(config_type)
    fields: dict[str, Any] = {}
    if preset is not None:
        fields["size"] = (Literal[tuple(preset)], next(iter(preset)))
    for f in dataclasses.fields(config_type):
        annotation = _section_types(hints[f.name])
        if preset is not None:
            mapping = typing.get_origin(annotation) is dict
            fields[f.name] = (annotation, {}) if mapping else (annotation | None, None)
        else:
            fields[f.name] = (annotation, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    section = create_model(f"{config_type.__name__}Section", __base__=ConfigSection,
                           __doc__=f"``{config_type.__module__}.{config_type.__name__}``", **fields)
    section.config_type, section.preset = config_type, preset
    return section


def _section_types(annotation: Any) -> Any:
    """``annotation`` with every config dataclass inside it replaced by its generated section."""
    if dataclasses.is_dataclass(annotation):
        return section_of(annotation)
    args = typing.get_args(annotation)
    if not args:
        return annotation
    origin = typing.get_origin(annotation)
    mapped = tuple(_section_types(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[mapped]
    return origin[mapped]


def _built(value: Any) -> Any:
    """A section value as its dataclass (sections inside dicts too)."""
    if isinstance(value, ConfigSection):
        return value.build()
    if isinstance(value, dict):
        return {k: _built(v) for k, v in value.items()}
    return value


BaselineSection = section_of(BaselineConfig)
KunlunSection = section_of(KunlunConfig, preset=KUNLUN_SIZES)
SasrecSection = section_of(SasrecConfig)
InterFormerSection = section_of(InterFormerConfig)


class DomainExpertsSection(Section):
    """Shared and per-domain (per-surface) Kunlun experts gated per domain; the experts follow ``[model.kunlun]``."""

    num_shared: int = Field(2, ge=0)
    num_specific: int = Field(1, ge=0)

    @model_validator(mode="after")
    def _some_expert(self) -> "DomainExpertsSection":
        if self.num_shared + self.num_specific == 0:
            raise ValueError("at least one expert is needed: num_shared + num_specific >= 1")
        return self


class ModelConfig(Section):
    name: Literal["kunlun", "baseline", "domain_experts", "sasrec", "interformer"] = "kunlun"
    # each task's weight in the loss (1 where unnamed); a negative one would maximise that task's loss
    task_weights: dict[str, Annotated[float, Field(ge=0)]] = {}
    kunlun: KunlunSection = KunlunSection()
    baseline: BaselineSection = BaselineSection()
    sasrec: SasrecSection = SasrecSection()
    domain_experts: DomainExpertsSection = DomainExpertsSection()
    interformer: InterFormerSection = InterFormerSection()


class SyntheticDataConfig(Section):
    num_surfaces: int = Field(3, ge=1)
    num_dense: int = Field(8, ge=1)
    num_ads: int = Field(20_000, ge=160)
    num_clusters: int = Field(16, ge=1)
    min_events: int = Field(4, ge=1)
    max_events: int = Field(256, ge=1)
    num_users: int = Field(0, ge=0)  # 0: every example a new user; else a population with user ids, in time order
    user_propensity: float = Field(0.0, ge=0)  # with num_users: std of each user's fixed click logit offset
    # the data's hidden truth and every draw from it; None: the run's seed. Fixed, runs of several seeds train on
    # the same data (as on a real data set) and their spread is the training's alone
    seed: int | None = Field(None, ge=0)


# the cut-offs K of HR@K / NDCG@K that each ranking protocol reports
RANKING_CUTOFFS = {"sampled": (1, 5, 10), "full": (5, 10, 20)}


class SequentialDataConfig(Section):
    """Next-item examples from a sequence file (``sequence_text``) or RecBole atomic files (``atomic``)."""

    attributes_file: str | None = None  # sequence_text: item -> attribute ids JSON (default: <name>_item2attributes.json)
    num_negatives: int = Field(1, ge=0)  # per positive; retrieval softmax: 0 scores against every item
    objective: Literal["pointwise", "retrieval"] = "pointwise"  # see gem_data.sequential.examples
    queries: Literal["last", "every"] = "last"  # retrieval: a query per prefix, or per history event (causal models)
    loss: Literal["binary", "softmax"] = "binary"  # retrieval
    sampler: Literal["uniform", "popularity"] = "uniform"
    popularity_power: float = 1.0
    max_history: int | None = Field(50, ge=1)
    attribute_slots: int = Field(4, ge=1)
    with_user_id: bool = False
    # time split (event-time quantiles online_from, next_from): offline | online | next period; mixture sources
    # read the offline period (shuffled) or, declared online, the online period in time order. A third quantile,
    # next_until, ends the next period early: a validation fold, e.g. [0.6, 0.8, 0.9] to tune what [0.7, 0.9] tests
    time_split: tuple[float, ...] | None = None
    # leave-one-out "valid" / "test"; a time split's "next_period" (every event from next_from, before next_until)
    # and "offline_period" (each user's held-out last offline event: forgetting), ranked among the items rated
    # before the event
    eval_split: Literal["valid", "test", "next_period", "offline_period"] = "test"
    eval_protocols: tuple[Literal["sampled", "full"], ...] = Field(("sampled",), min_length=1)
    eval_negatives: int = Field(99, ge=1)
    eval_seeds: tuple[int, ...] = Field((0,), min_length=1)
    # a fixed random subset of the evaluation's queries (None: all): one per user, or a time split's next-period
    # events (several per user)
    eval_users: int | None = Field(None, ge=1)
    eval_chunk: int = Field(8192, ge=1)

    @model_validator(mode="after")
    def _negatives_fit_objective(self) -> "SequentialDataConfig":
        for name in ("eval_protocols", "eval_seeds"):  # a repeat would be reported as agreeing draws
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"data.sequential.{name} lists a value twice: {list(values)}")
        deepest = max(RANKING_CUTOFFS["sampled"])
        if "sampled" in self.eval_protocols and self.eval_negatives + 1 <= deepest:
            raise ValueError(f"data.sequential.eval_negatives ({self.eval_negatives}) ranks each target among "
                             f"{self.eval_negatives + 1} candidates: the sampled protocol's HR@{deepest} would count "
                             f"every target a hit whatever the model; set it to at least {deepest}")
        if self.objective == "retrieval" and self.loss == "binary" and self.num_negatives < 1:
            raise ValueError("data.sequential.num_negatives must be >= 1 for loss = \"binary\" (0, every item, is softmax only)")
        if self.objective == "pointwise" and (self.queries != "last" or self.loss != "binary"):
            raise ValueError("data.sequential.queries and .loss apply to objective = \"retrieval\" only")
        cuts = None if self.time_split is None else self.time_split if len(self.time_split) == 3 else (*self.time_split, 1.0)
        if cuts is not None and not (len(cuts) == 3 and 0 < cuts[0] < cuts[1] < cuts[2] <= 1):
            raise ValueError(f"data.sequential.time_split must be event-time quantiles 0 < online_from < next_from < 1, or "
                             f"0 < online_from < next_from < next_until <= 1 for a validation fold, got {list(self.time_split)}")
        if self.eval_split in ("next_period", "offline_period") and self.time_split is None:
            raise ValueError(f"data.sequential.eval_split = \"{self.eval_split}\" needs data.sequential.time_split")
        if self.time_split is not None and self.queries == "every":
            raise ValueError("data.sequential.time_split trains on events in time order: use queries = \"last\"")
        return self


class MixtureSourceConfig(Section):
    """One source of the mixture, read in place: any reader, a weight, a domain, an id space."""

    name: str = Field(pattern=r"^\S+$")  # the log's source_<name> / share_<name> keys
    weight: float = Field(1.0, gt=0)
    # online: a near-real-time stream, read once in time order; a next-item source is then the online period of
    # data.sequential.time_split (offline next-item sources read the offline period, shuffled, or, without event
    # times, all their examples), a parquet source its file(s) in row order
    online: bool = False
    reader: Literal["synthetic", "sequence_text", "atomic", "parquet"] | None = None  # None: data.source
    path: str | None = None  # None: data.path
    eval_path: str | None = None  # parquet held-out file(s) (None: data.eval_path)
    surface: int | None = Field(None, ge=0)  # domain id stamped on every example (None: the reader's own)
    # sources naming one id space share ids (and must declare the same features); sources reading the same
    # data (reader and path) share one by default; any other source has its own, disjoint, namespace
    id_space: str | None = None
    # synthetic: which of the generator's disjoint streams (same ground truth); two synthetic sources need two
    seed: int = Field(0, ge=0, lt=128)


class MixtureConfig(Section):
    """Interleave several sources by weight (zero-copy mixing); empty: one source (``data.source``)."""

    sources: tuple[MixtureSourceConfig, ...] = ()
    granularity: Literal["example", "batch"] = "example"
    # online share schedule: online_share_start until ramp_start, then linear to online_share_end over ramp_steps
    # (0: a switch, i.e. sequential fine-tuning); without online_share_end the share stays constant
    online_share_start: float | None = Field(None, ge=0, le=1)
    online_share_end: float | None = Field(None, ge=0, le=1)
    ramp_start: int = Field(0, ge=0)
    ramp_steps: int = Field(0, ge=0)
    eval_source: str | None = None  # whose held-out data evaluation reads (None: the first source)

    @model_validator(mode="after")
    def _schedule_needs_both_groups(self) -> "MixtureConfig":
        if not self.sources:
            given = self.changed("online_share_start", "online_share_end", "ramp_start", "ramp_steps", "granularity")
            if given:
                raise ValueError(f"data.mixture.{given[0]} schedules a mixture, which has no sources "
                                 f"([[data.mixture.sources]])")
        if self.online_share_end is not None and self.online_share_start is None:
            raise ValueError("data.mixture.online_share_end needs online_share_start")
        if self.online_share_end is None and (self.ramp_start or self.ramp_steps):
            raise ValueError("data.mixture.ramp_start / ramp_steps move the online share to online_share_end, which is "
                             "not set (without it the share stays constant)")
        if self.online_share_start is not None and self.sources:
            online = [s.online for s in self.sources]
            if all(online) or not any(online):
                raise ValueError("data.mixture.online_share_start: an online share schedule needs online and offline sources")
        if not math.isfinite(sum(s.weight for s in self.sources)):
            raise ValueError("data.mixture.sources: the weights' sum must be finite (only their ratios matter)")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.mixture.sources names must be unique, got {names}")
        if self.eval_source is not None and self.eval_source not in names:
            raise ValueError(f"data.mixture.eval_source names {self.eval_source!r}, not one of the sources {names}")
        return self

    @property
    def evaluated(self) -> str | None:
        """The source whose held-out data evaluation reads: ``eval_source``, else the first (None without sources)."""
        return self.eval_source or (self.sources[0].name if self.sources else None)


class DataConfig(Section):
    source: Literal["synthetic", "sequence_text", "atomic", "parquet"] = "synthetic"
    path: str | None = None  # the data file (sequence_text, parquet) or folder (atomic)
    eval_path: str | None = None  # parquet: held-out file(s)
    batch_size: int = Field(256, ge=1)
    # synthetic held-out global batches (of batch_size x ranks examples: runs of one global batch size evaluate
    # the same examples); a parquet eval_path is read whole
    eval_batches: int = Field(40, ge=1)
    num_workers: int = Field(0, ge=0)
    # batches read on a background thread one step ahead (true), or on the training thread when the step asks
    # (false: the same batches without a thread, the thread's reference; see gem_data.read_ahead)
    read_ahead: bool = True
    # with read_ahead, Python's thread switch interval while the trainer lives (sys.setswitchinterval; close()
    # restores it): how long the training thread may wait for the interpreter lock while the reader holds it. A small
    # model's step waits on the host, and at Python's 5 ms default the reader can hold up a whole step's launches
    # (compare: gem_trainer.bench_paired --variant A --variant "B: data.read_ahead_switch_ms=0"); 0: Python's setting
    read_ahead_switch_ms: float = Field(0.2, ge=0, le=1000)
    # with read_ahead, read in a forked process instead of a thread (gem_data.process_read_ahead): the reader's
    # Python then no longer shares the training process's interpreter, and a batch arrives as one buffer to copy.
    # Not with num_workers (its own processes) or a Solaris input (a teacher or a server connection in the stream)
    read_ahead_process: bool = False
    # rows a table reader (sequence_text, atomic, parquet) reads at a time, several batches of a small batch size
    # sharing a read's fixed cost; the batches are the same for any value (0: one batch per read)
    read_rows: int = Field(READ_ROWS, ge=0)
    skip_bad_rows: bool = False
    balance: bool = False  # length-balanced batches across ranks
    balance_window: int = Field(1, ge=1)
    # train only on examples of these surfaces (domains): one model per domain on the examples of its domain that a
    # shared model reads (None: every surface); a global batch with fewer of them than ranks is skipped, and the log
    # counts the skipped batches (surfaces_skipped_batches) and the examples they held
    train_surfaces: tuple[int, ...] | None = None
    synthetic: SyntheticDataConfig = SyntheticDataConfig()
    sequential: SequentialDataConfig = SequentialDataConfig()
    mixture: MixtureConfig = MixtureConfig()

    def readers(self) -> set[str]:
        """The readers the data is read with: each mixture source's (``data.source`` where it names none), else
        ``data.source``."""
        return {s.reader or self.source for s in self.mixture.sources} or {self.source}

    @model_validator(mode="after")
    def _source_needs(self) -> "DataConfig":
        sources = self.mixture.sources
        readers = [(s.reader or self.source, s.path, s.eval_path, s.name) for s in sources] or [(self.source, None, None, None)]
        evaluated = self.mixture.evaluated
        for reader, path, eval_path, name in readers:
            where = f"data.mixture.sources.{name}" if name is not None else "data"
            if reader != "synthetic" and path is None and self.path is None:
                raise ValueError(f"data.path is required for data.source = {reader!r}" if name is None
                                 else f"{where}: reader {reader!r} needs a path (or data.path)")
            if reader == "parquet" and name == evaluated and eval_path is None and self.eval_path is None:
                raise ValueError("data.eval_path (held-out parquet) is required for data.source = \"parquet\"" if name is None
                                 else f"{where}: the evaluated parquet source needs an eval_path (or data.eval_path)")
        # settings with nothing to apply to are refused, not dropped (a held-out file never read looks evaluated)
        read = self.readers()
        if self.eval_path is not None and "parquet" not in read:
            raise ValueError(f"data.eval_path names held-out parquet files, but no source reads parquet ({sorted(read)})")
        for s in sources:
            reader = s.reader or self.source
            unused = [field for field in ("path", "eval_path") if getattr(s, field) is not None
                      and (reader == "synthetic" or (field == "eval_path" and reader != "parquet"))]
            if unused:
                why = "a synthetic source reads no file" if reader == "synthetic" else \
                    f"held-out parquet files, but the source reads {reader} data"
                raise ValueError(f"data.mixture.sources.{s.name}.{unused[0]}: {why}")
        if self.sequential.attributes_file is not None and "sequence_text" not in read:
            raise ValueError(f"data.sequential.attributes_file applies to sequence_text data, which no source reads "
                             f"({sorted(read)})")
        if self.balance_window != 1 and not self.balance:
            raise ValueError("data.balance_window applies to data.balance = true")
        next_item = ("sequence_text", "atomic")
        if self.sequential.time_split is not None and not any(reader in next_item for reader, *_ in readers):
            raise ValueError("data.sequential.time_split cuts a next-item source's events by time: no source reads "
                             "atomic (or sequence_text) data")
        evaluated_reader = next((reader for reader, _, _, name in readers if name == evaluated), readers[0][0])
        if self.sequential.eval_split in ("next_period", "offline_period") and evaluated_reader not in next_item:
            raise ValueError(f"data.sequential.eval_split = \"{self.sequential.eval_split}\" ranks a next-item source's "
                             f"events: the evaluated source reads {evaluated_reader} data")
        for s in sources:
            if s.online and (s.reader or self.source) == "sequence_text":
                raise ValueError(f"data.mixture.sources.{s.name}: an online source is read in time order, and a sequence "
                                 f"file holds no event times: use atomic files with a timestamp field, or parquet")
            if s.online and (s.reader or self.source) == "atomic" and self.sequential.time_split is None:
                raise ValueError(f"data.mixture.sources.{s.name}: an online next-item source is the online period of a time "
                                 f"split, read in time order: set data.sequential.time_split")
        streams: dict[int, str] = {}
        for s in sources:
            if (s.reader or self.source) == "synthetic":
                if s.seed in streams:
                    raise ValueError(f"data.mixture.sources.{s.name}.seed: {s.seed}, as source {streams[s.seed]!r}: both would "
                                     f"read the generator's stream {s.seed}, the same examples (give each its own seed)")
                streams[s.seed] = s.name
        # the other readers' sections: a setting of one no source reads is refused, not dropped
        unread = [("synthetic", self.synthetic, "synthetic data")] if "synthetic" not in read else []
        unread += [("sequential", self.sequential, "next-item data (sequence_text, atomic)")] if not read & set(next_item) else []
        for name, section, what in unread:
            changed = section.changed()
            if changed:
                raise ValueError(f"data.{name}.{changed[0]} applies to {what}, which no source reads ({sorted(read)})")
        if self.train_surfaces is not None and self.balance:
            raise ValueError("data.train_surfaces gives batches of varying size, which data.balance cannot split evenly")
        if self.read_ahead_process and not self.read_ahead:
            raise ValueError("data.read_ahead_process reads ahead in a process: it needs data.read_ahead = true")
        if self.read_ahead_process and self.num_workers:
            raise ValueError("data.read_ahead_process and data.num_workers both read in other processes: choose one")
        if self.read_ahead_process:
            from gem_data.process_read_ahead import process_reading_available

            why_not = process_reading_available()
            if why_not is not None:
                raise ValueError(f"data.read_ahead_process: {why_not}")
        return self


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0)
    # AdamW's decoupled decay of every dense parameter (biases and norms included; the tables have their own,
    # fused optimizer and none)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0)
    # fused into the embedding backward: row-wise Adagrad, or plain SGD (linear in the gradient: averaged
    # 2-D sparse replicas then equal one process exactly)
    sparse: Literal["rowwise_adagrad", "sgd"] = "rowwise_adagrad"
    sparse_lr: float = Field(0.05, gt=0)  # constant: schedule.warmup_steps and decay shape the dense rate only
    sparse_eps: float = Field(1e-8, gt=0)


class ScheduleConfig(Section):
    steps: int = Field(600, ge=1)
    # training length in passes over the training data; set, it decides schedule.steps from the data's size (when the
    # data is built: builders.resolve_schedule), so that a recipe carries across data sets of other sizes
    epochs: float | None = Field(None, gt=0)  # of steps and epochs the later layer wins (config._drop_replaced_length)
    warmup_steps: int = Field(50, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class ParallelismConfig(Section):
    """How ranks share the work (``gem_parallel.ParallelDims``; -1: automatic). Checked against the world
    size when the job starts."""

    nproc_per_node: int = Field(1, ge=1)  # processes per node for `launch`
    collectives: Literal["auto", "nccl", "copy_engine", "gloo"] = "auto"  # auto: NCCL on GPUs, Gloo on CPU
    # dense (FSDP2 / HSDP): replicas x shard group; -1 + -1: shard inside a node, replicate across nodes
    dense_replicate: int = Field(-1, ge=-1)
    dense_shard: int = Field(-1, ge=-1)
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # FSDP2 mixed precision of the blocks
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    # torch.compile each block: "default" fuses a block's ops; "reduce-overhead" also replays its forward and
    # backward as CUDA graphs (SASRec: its blocks chained, fixed shapes in its padded layout; one process);
    # true / false: "default" / "off"
    compile: Literal[COMPILE_MODES] = "off"  # "off", "default" or "reduce-overhead"
    # torch.compile each MoE on its own (fixed shapes: a batch's examples and tokens): "auto" where blocks are not
    # compiled, on a GPU, in one process without FSDP mixed precision
    compile_experts: Literal["auto", "on", "off"] = "auto"
    # replay the fixed-shape parts of each Kunlun layer (compression, MoE) and trunk (head) as CUDA graphs in
    # training, one forward and one backward graph per batch shape: no compiler host time per call (a small model's
    # step waits on the host); "auto" where they apply: on a GPU, in one process without FSDP mixed precision,
    # blocks and MoEs not compiled, no activation checkpointing, MoEs with a capacity; true / false: "on" / "off"
    cuda_graphs: Literal["auto", "on", "off"] = "off"
    # a folder for Triton's compiled kernels and Inductor's compiled graphs that jobs share (storage every machine
    # mounts): a job restarted elsewhere loads them instead of compiling again (None: each machine's own caches)
    compile_cache_dir: str | None = None
    # with CUDA graphs on: > 0 pads Kunlun's jagged history to multiples of this many tokens (padding segments after
    # the examples; the examples' outputs unchanged) and replays each trunk whole, one pair of graphs per batch size
    # and bucket; 0 keeps the history eager (only the fixed-shape parts above replayed)
    cuda_graph_history_bucket: int = Field(0, ge=0)
    # expert parallelism of the MoE: experts split over groups of this many ranks (inside a dense shard group)
    expert: int = Field(1, ge=1)
    # equal-split all-to-all (fixed shapes, capacity per rank), its messages sized for the most rows a rank can pass
    # a MoE: data.batch_size (x data.balance_window with data.balance; x 2 with a contrastive weight: two views)
    expert_padded: bool = False
    # sparse (TorchRec): tables sharded over groups of sparse_group ranks, replicated across groups
    sparse_group: int = Field(-1, ge=-1)
    sparse_sharding: Literal["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"] = "table_wise"
    sparse_sync_every: int = Field(1, ge=1)  # steps between replica averages (2-D sparse)
    sparse_index_dedup: bool = False  # sequence ids sent once per distinct id (CUDA)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_switch(cls, value: Any) -> Any:
        return {True: "default", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _cuda_graphs_switch(cls, value: Any) -> Any:
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _no_zero_degrees(self) -> "ParallelismConfig":
        for name in ("dense_replicate", "dense_shard", "sparse_group"):
            if getattr(self, name) == 0:
                raise ValueError(f"parallelism.{name} must be >= 1 or -1 (automatic), got 0")
        if self.cuda_graphs == "on" and (self.compile_experts == "on" or self.compile != "off" or self.activation_checkpointing):
            raise ValueError("parallelism.cuda_graphs replays eager layers' parts as CUDA graphs: it needs compile = \"off\", "
                             "compile_experts \"off\" or \"auto\" and activation_checkpointing = false")
        if self.cuda_graph_history_bucket and self.cuda_graphs == "off":
            raise ValueError("parallelism.cuda_graph_history_bucket pads the history for a CUDA graph of the trunk: it "
                             "needs cuda_graphs = \"auto\" or \"on\"")
        if self.expert_padded and self.expert == 1:
            raise ValueError("parallelism.expert_padded sizes the all-to-all of expert parallelism: it needs expert > 1")
        if self.compile_experts == "on" and self.compile != "off":
            raise ValueError(f"parallelism.compile_experts = \"on\" compiles the MoEs of blocks left eager; with "
                             f"compile = {self.compile!r} each block is compiled, its MoE with it")
        return self


class PrecisionConfig(Section):
    autocast: Literal["auto", "bf16", "off"] = "auto"
    # GEMMs in low precision: "fp8" runs FP8 tensor cores with the scales of fp8_scaling (Hopper;
    # gem_kernels.fp8_linear; with rowwise scales a LayerNorm feeding a converted Linear-GELU-Linear runs as one block
    # whose norm and GELU write the GEMMs' FP8 operands, gem_kernels.fp8_mlp), "mxfp8_emulated" the numerics of MX
    # tensor cores on any device (quality studies; gem_kernels.mx_linear)
    low_precision: Literal["off", "fp8", "mxfp8_emulated"] = "off"
    # fp8: the weight-gradient GEMM in the input's precision ("high") or FP8 too
    fp8_weight_gradient: Literal["high", "fp8"] = "high"
    # fp8: one scale per row ("rowwise"), or per 1 x 128 block of activations and gradients and 128 x 128 block of
    # weights ("blockwise": layers whose features are multiples of 128; their linears quantise their own inputs)
    fp8_scaling: Literal["rowwise", "blockwise"] = "rowwise"
    # fp8: where it does not pay, layers narrower than this (in or out features) and calls with fewer rows than
    # fp8_min_tokens stay in high precision (default: the crossover measured on an H200, see Fp8Recipe)
    fp8_min_features: int = Field(Fp8Recipe.min_features, ge=0)
    fp8_min_tokens: int = Field(Fp8Recipe.min_tokens, ge=0)
    # the sequence self-attention (Kunlun's and InterFormer's local attention) with FP8 Q, K and V: forward on FP8
    # tensor cores, backward the exact gradient at the quantised operands (gem_kernels' fp8=True); outside
    # high_precision, independent of low_precision
    fp8_attention: bool = False
    mx_elem: Literal["e4m3", "e5m2"] = "e4m3"  # activations and weights
    mx_grad_elem: Literal["e4m3", "e5m2"] = "e5m2"  # output gradients
    mx_rounding: Literal["floor", "rceil"] = "floor"  # shared-scale rule
    # modules whose dotted name has one of these parts stay in high precision: the embeddings, the heads and
    # what feeds the loss (a two-tower's query map and item tower, whose product is the score), the MoE gate
    # (routing flips on small logit changes)
    high_precision: list[str] = ["embedding", "heads", "gate", "query", "item_tower", "auxiliary_head", "adapter"]


class CheckpointConfig(Section):
    enable: bool = True
    every_steps: int = Field(200, ge=1)
    keep_latest: int = Field(2, ge=1)
    resume: bool = True
    # training waits only while the state is copied to host memory; the files are written in the background
    asynchronous: bool = True


class MetricsConfig(Section):
    log_every: int = Field(50, ge=1)
    tensorboard: bool = True
    progress_bar: bool = True
    peak_tflops: float | None = Field(None, gt=0)
    # examples/s of one device at the same per-device batch: with it the log splits mfu (end to end) into
    # mfu_local x scaling_ratio
    single_device_examples_per_s: float | None = Field(None, gt=0)


class EvalConfig(Section):
    every_steps: int | None = Field(None, ge=1)
    at_end: bool = True


class DistillationConfig(Section):
    """Train this model as a student of a finished run (the teacher): its ``config.toml`` and latest checkpoint.

    Online, the teacher runs inside every student step. Offline, ``gem-trainer posttrain`` runs it once over
    this config's training stream and writes its logits to ``soft_labels`` (a folder); ``train`` / ``distill``
    with ``soft_labels`` set then read them from there and never load the teacher.

    ``top_k`` (retrieval data, offline): the teacher scores the whole catalogue in the ``posttrain`` pass and
    its ``top_k`` best items per query other than the next one are stored (with the next item's logit), in
    place of its scores of the student's sampled candidates; the student distils on those items. ``tail_samples``:
    also that many items per query drawn uniformly from the rest of the catalogue, each standing for its share of
    the rest, so that distillation (and the adapter's fit) estimate the teacher's softmax over every item rather
    than over its best k alone."""

    teacher_run_dir: str | None = None
    # the teacher's checkpoint (None: its newest when the run starts; a run records the step it took and a resumed
    # run keeps it, whatever the teacher has trained since). With soft_labels the store's teacher and checkpoint are
    # what the run trains on: teacher_run_dir / teacher_step (and top_k + tail_samples), where given, must be them
    teacher_step: int | None = Field(None, ge=0)
    soft_labels: str | None = None
    top_k: int | None = Field(None, ge=1)
    tail_samples: int = Field(0, ge=0)
    # the distillation term's weight: the term is a mean over the auxiliary head's tasks (every task, whatever
    # model.task_weights says) where the label loss sums its tasks' terms
    weight: float = Field(1.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    adapter: bool = True


class LoopFMConfig(Section):
    """LoopFM: the teacher's compact representation of every example, kept per user in time order, read back by
    the student as an extra input.

    ``gem-trainer posttrain`` (with ``distillation.teacher_run_dir``) writes ``store`` in the same teacher pass
    as the soft labels: layer ``layer`` of the teacher (``"representation"``: what its heads read, or a dotted
    submodule name) projected to ``dim`` values by the fixed Gaussian matrix of ``projection_seed``, keyed by
    the sparse feature ``user_feature`` and the example's time; a pass cut short continues when run again.
    ``train`` / ``distill`` with ``store`` set give every example the newest ``max_events`` representations of
    its user strictly before its time, as the representation feature ``loopfm``; ranking evaluation joins them
    to every request it scores.

    ``key_only``: ``user_feature`` keys the store and is no model's input: the teacher's pass and the student
    read the data without it. Next-item data has user ids with ``data.sequential.with_user_id = true``, as a
    sparse feature the models would otherwise embed; there a teacher trained without user ids needs it."""

    store: str | None = None
    layer: str = "representation"
    dim: int = Field(16, ge=1)
    projection_seed: int = 0
    user_feature: str = "user_id"
    max_events: int = Field(32, ge=1)
    key_only: bool = False


class SolarisConfig(Section):
    """Speculative precompute (``gem-trainer precompute``, ``gem_transfer.solaris``): the teacher of
    ``distillation.teacher_run_dir`` scores candidate pairs of this config's data (each row a (user, candidate)
    pair) into a cache that serving looks up, falling back to the user's recent embeddings in the item's group,
    to similar users, then to a default."""

    output: str | None = None  # folder for report.json, the user index, the default and the in-process cache
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "solaris"  # Redis keys are {key_prefix}:...
    item_feature: str = "ad_id"  # the sparse feature naming the candidate (one id per row)
    group_feature: str = "advertiser_id"  # the sparse feature grouping candidates (one id per row)
    user_feature: str | None = None  # a user-id sparse feature; None: a fingerprint of each row's request side
    pairs: int = Field(8192, ge=1)  # rows of the training stream the pass reads: its first rows (whole batches)
    # share of those rows the earlier stage predicted (precomputed; drawn per row): below 1, a student trained on
    # served inputs meets exact answers and fallbacks side by side all through training, as serving does
    train_share: float = Field(1.0, gt=0, le=1)
    lookups: int = Field(2048, ge=1)  # lookups replayed for the report, per kind of traffic
    ttl_s: float = Field(3600.0, gt=0)  # entries older than this are not served
    recent: int = Field(8, ge=1)  # entries kept per user and item group
    neighbours: int = Field(8, ge=0)  # similar users asked (0: no neighbour level)
    behaviour_dim: int = Field(64, ge=8)  # width of the hashed behaviour vectors the neighbour search compares
    queue_batches: int = Field(4, ge=1)  # batches waiting for the teacher before the reader waits
    # share of the held-out pairs the earlier stage also predicted (precomputed too; the rest fall back)
    eval_share: float = Field(0.0, ge=0, le=1)
    teacher_run_dir: str | None = None  # the teacher of precompute and student_input (None: distillation.teacher_run_dir)
    # the student reads the teacher's embedding of each example's pair as the representation feature "solaris":
    # computed by the teacher for every batch ("fresh") or looked up from the precompute at output ("served")
    student_input: Literal["none", "fresh", "served"] = "none"

    @model_validator(mode="after")
    def _distinct_keys(self) -> "SolarisConfig":
        if self.item_feature == self.group_feature or self.user_feature in (self.item_feature, self.group_feature):
            raise ValueError("solaris.item_feature, .group_feature and .user_feature must name different features")
        return self


class TrainerConfig(Section):
    run_dir: str = Field("runs/default", pattern=r"\S")  # not blank: checkpoints would go to the filesystem's root
    # the data streams fold it with epoch and block counters into 64-bit generator seeds
    seed: int = Field(0, ge=0, lt=2**24)
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    parallelism: ParallelismConfig = ParallelismConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    eval: EvalConfig = EvalConfig()
    distillation: DistillationConfig = DistillationConfig()
    loopfm: LoopFMConfig = LoopFMConfig()
    solaris: SolarisConfig = SolarisConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> "TrainerConfig":
        # NOTE: with schedule.epochs the steps are known once the data is built; builders.resolve_schedule checks then
        if self.schedule.epochs is None and self.schedule.warmup_steps >= self.schedule.steps:
            raise ValueError(
                f"schedule.warmup_steps ({self.schedule.warmup_steps}) must be below schedule.steps ({self.schedule.steps}): "
                f"a shorter run sets both, e.g. --schedule.warmup_steps={self.schedule.steps // 10}"
            )
        if Path(self.run_dir).exists() and not Path(self.run_dir).is_dir():
            raise ValueError(f"run_dir: {self.run_dir} is a file, not a folder")
        if self.schedule.epochs is not None and (self.data.mixture.sources or self.data.source == "synthetic"):
            source = "data.mixture" if self.data.mixture.sources else "data.source = \"synthetic\""
            raise ValueError(f"schedule.epochs needs a finite data set, but {source} is an endless stream: set schedule.steps")
        synthetic = self.data.synthetic
        if synthetic.min_events > synthetic.max_events:
            raise ValueError("data.synthetic.min_events must not exceed data.synthetic.max_events")
        if synthetic.num_ads < 10 * synthetic.num_clusters:
            raise ValueError("data.synthetic.num_ads must be at least 10 * data.synthetic.num_clusters")
        if synthetic.user_propensity and not synthetic.num_users:
            raise ValueError("data.synthetic.user_propensity needs data.synthetic.num_users (a population of returning users)")
        if self.data.read_ahead_process and self.solaris.student_input != "none":
            raise ValueError("data.read_ahead_process: the Solaris input (solaris.student_input) runs a teacher or holds a "
                             "server connection inside the data stream, which a forked reading process must not")
        self._check_retrieval()
        self._check_loopfm()
        self._check_unused_transfer_settings()
        return self

    def _check_unused_transfer_settings(self) -> None:
        """Distillation and LoopFM settings with nothing to apply them to are refused, not dropped (a student trained
        without its teacher would be reported as distilled)."""
        d, loop = self.distillation, self.loopfm
        if d.teacher_run_dir is None and d.soft_labels is None:
            changed = d.changed("weight", "temperature", "adapter")
            if changed:
                raise ValueError(f"distillation.{changed[0]} applies to a student of a teacher: set distillation.teacher_run_dir "
                                 f"or distillation.soft_labels")
            if d.teacher_step is not None and self.solaris.teacher_run_dir is None:
                raise ValueError("distillation.teacher_step picks the teacher's checkpoint: set distillation.teacher_run_dir")
        if loop.store is None:
            changed = loop.changed()  # the store is None: every other field
            if changed:
                raise ValueError(f"loopfm.{changed[0]} applies to a LoopFM store: set loopfm.store")

    def _check_loopfm(self) -> None:
        """The LoopFM input reaches the models that read representation features; on next-item data each stored
        example must be one event of its user."""
        if self.loopfm.store is None:
            return
        soft_labels = self.distillation.soft_labels
        if soft_labels is not None and Path(soft_labels).resolve() == Path(self.loopfm.store).resolve():
            raise ValueError(f"loopfm.store and distillation.soft_labels name the same folder ({self.loopfm.store}): "
                             f"posttrain writes two stores, one in each")
        if self.model.name == "sasrec":
            raise ValueError("loopfm.store: SASRec reads item ids only; use model.name = \"kunlun\", \"interformer\", "
                             "\"domain_experts\" or \"baseline\"")
        if self.data.source in ("sequence_text", "atomic") and self.data.sequential.objective != "retrieval":
            # NOTE: a pointwise next-item example is one of 1 + num_negatives rows, mostly sampled candidates the user
            # never met; a retrieval example is the request itself
            raise ValueError("loopfm.store on next-item data needs data.sequential.objective = \"retrieval\" (pointwise "
                             "rows are sampled candidates, not the user's events)")

    def _check_retrieval(self) -> None:
        """Retrieval examples need a model whose request side ignores the candidate."""
        s, m = self.data.sequential, self.model
        two_tower = m.name == "kunlun" and m.kunlun.build().two_tower
        if self.distillation.top_k is not None:
            if self.data.source not in ("sequence_text", "atomic") or s.objective != "retrieval":
                raise ValueError("distillation.top_k applies to next-item data with data.sequential.objective = "
                                 "\"retrieval\" (the teacher ranks the catalogue)")
            if self.distillation.soft_labels is None:
                raise ValueError("distillation.top_k chooses what posttrain stores in distillation.soft_labels: set it "
                                 "(online distillation scores the student's own candidates)")
        elif self.distillation.tail_samples:
            raise ValueError("distillation.tail_samples extends the teacher's top k (distillation.top_k): set it")
        if m.kunlun.two_tower and m.name != "kunlun":
            raise ValueError(f"model.kunlun.two_tower applies to model.name = \"kunlun\", not {m.name!r}")
        if m.kunlun.build().contrastive_weight and m.name != "kunlun":  # the domain experts' model encodes one view only
            raise ValueError(f"model.kunlun.contrastive_weight applies to model.name = \"kunlun\", not {m.name!r}")
        if self.data.source not in ("sequence_text", "atomic"):
            if m.name == "sasrec":
                raise ValueError("model.name = \"sasrec\" needs next-item data (data.source = \"sequence_text\" or \"atomic\")")
            if s.objective == "retrieval" or two_tower:
                raise ValueError("data.sequential.objective = \"retrieval\" and model.kunlun.two_tower need next-item data "
                                 "(data.source = \"sequence_text\" or \"atomic\")")
            return
        if s.objective == "retrieval" and not (m.name == "sasrec" or two_tower):
            raise ValueError(f"data.sequential.objective = \"retrieval\" needs model.name = \"sasrec\" or a Kunlun with "
                             f"model.kunlun.two_tower = true, not {m.name!r}")
        if s.queries == "every" and m.name != "sasrec":
            raise ValueError("data.sequential.queries = \"every\" needs a causal model (model.name = \"sasrec\")")
        if s.queries == "every" and (s.max_history is None or s.max_history > m.sasrec.max_seq_len):
            raise ValueError(f"data.sequential.max_history ({s.max_history}) must not exceed model.sasrec.max_seq_len "
                             f"({m.sasrec.max_seq_len}) with queries = \"every\"")
        # NOTE: a top-k store holds the teacher's best items of the catalogue, which a student trained against the
        # catalogue distils on as one trained against sampled items does; other distillation scores the candidates
        distilling = self.distillation.teacher_run_dir is not None or self.distillation.soft_labels is not None
        if s.objective == "retrieval" and distilling and s.num_negatives < 1 and self.distillation.top_k is None:
            raise ValueError("distillation of retrieval scores sampled candidates: set data.sequential.num_negatives >= 1 "
                             "(or distil on the teacher's top k of the catalogue: distillation.top_k)")


def with_schedule_steps(config: TrainerConfig, steps: int) -> TrainerConfig:
    """``config`` with ``schedule.steps = steps`` (what ``schedule.epochs`` resolved to once the data was read)."""
    return config.model_copy(update={"schedule": config.schedule.model_copy(update={"steps": steps})})


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainerConfig:
    """Read ``path`` (the embedded default when None), resolve ``base`` chains, apply ``overrides``, validate.

    An error names where the bad value came from: the override that set it, the base file that holds it, or
    the file itself.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    origins: dict[tuple[str, ...], str] = {}
    raw = _read_with_bases(path, chain=(), origins=origins)
    for item in overrides:
        _apply_override(raw, item, origins)
    try:
        return TrainerConfig.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        loc = tuple(str(p) for p in first["loc"])
        where = f"{'.'.join(loc)}: " if loc else ""  # a check across sections names its fields in its message
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        elif "input" in first and first["type"] not in ("missing",) and not isinstance(first["input"], dict):
            message = f"{message} (got {first['input']!r})"
        more = f" (+{error.error_count() - 1} more)" if error.error_count() > 1 else ""
        source = _origin_of(origins, loc, str(path), message)
        raise ConfigError(f"{source}: {where}{message}{more}") from None


def _origin_of(origins: dict[tuple[str, ...], str], loc: tuple[str, ...], default: str, message: str = "") -> str:
    """Where the value at ``loc`` came from. For a section-level error (a check across its fields), an override
    of one of its fields is the likeliest culprit (one the message names first), then the one file all its fields
    come from. A check across
    sections names its fields in ``message``: the last override of one of them, else the config file."""
    if not loc:
        named = [source for key, source in origins.items() if source.startswith("override ") and ".".join(key) in message]
        return named[-1] if named else default
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            return origins[loc[:n]]
    inside = [(key, source) for key, source in origins.items() if key[: len(loc)] == loc]
    overrides = [(key, source) for key, source in inside if source.startswith("override ")]
    named = [source for key, source in overrides if ".".join(key) in message]
    if named or overrides:  # the override of a field the message names, else the last override in the section
        return (named or [source for _, source in overrides])[-1]
    inside = [source for _, source in inside]
    return inside[0] if inside and len(set(inside)) == 1 else default


def _read_with_bases(path: Path, chain: tuple[Path, ...], origins: dict[tuple[str, ...], str]) -> dict[str, Any]:
    """The merged contents of ``path`` and its bases; ``origins`` maps every value's dotted key to its file."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"{chain[-1]}: base: inheritance cycle {cycle}")
    if not path.is_file():
        where = f"{chain[-1]}: base: " if chain else ""
        raise ConfigError(f"{where}config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8 text
        raise ConfigError(f"{path}: not a UTF-8 text file ({error.reason} at byte {error.start})") from None
    base = data.pop("base", None)
    parent: dict[str, Any] = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base: must be a file path string (got {base!r})")
        parent = _read_with_bases(path.parent / base, (*chain, resolved), origins)
    _record(origins, data, (), str(path))
    if isinstance(data.get("schedule"), dict):
        _drop_replaced_length(parent, data["schedule"])
    return _merge(parent, data)


def _record(origins: dict[tuple[str, ...], str], data: dict[str, Any], prefix: tuple[str, ...], source: str) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            _record(origins, value, (*prefix, key), source)
        else:
            origins[(*prefix, key)] = source


def _drop_replaced_length(earlier: dict[str, Any], schedule: dict[str, Any]) -> None:
    """``schedule.steps`` and ``schedule.epochs`` are two ways to give the training length: a later layer that
    gives one (a file over its base, an override over its file) drops the other from ``earlier``, so that
    ``--schedule.steps=40`` shortens a recipe given in epochs. Inside one layer the epochs win (a run record
    holds both: the steps are what its epochs resolved to)."""
    given = [key for key in ("steps", "epochs") if key in schedule]
    if len(given) == 1 and isinstance(earlier.get("schedule"), dict):
        earlier["schedule"].pop("epochs" if given == ["steps"] else "steps", None)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _apply_override(raw: dict[str, Any], item: str, origins: dict[tuple[str, ...], str]) -> None:
    text = item.removeprefix("--")
    if "=" not in text:
        raise ConfigError(f"override {item!r}: expected --section.field=value")
    dotted, value_text = text.split("=", 1)
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"override {item!r}: empty field name")
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = _number_or_text(value_text)
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {key} is not a section")
        node = child
    if keys[0] == "schedule":
        _drop_replaced_length(raw, value if len(keys) == 1 and isinstance(value, dict) else {keys[-1]: None})
    node[keys[-1]] = value
    origins[tuple(keys)] = f"override {item}"


def dump_config(config: TrainerConfig) -> str:
    """The resolved config as TOML text (sections after top-level values; a None value omitted where it is the
    field's default, else written as "none", which switches it off again when read)."""
    lines: list[str] = []
    data = config.model_dump(mode="json")
    _spell_out_none(config, data)

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) or not v or _is_map(k)}
        sections = {k: v for k, v in table.items() if k not in scalars}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for key, value in scalars.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
        for key, value in sections.items():
            emit(value, f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key))

    emit(data, "")
    return "\n".join(lines).lstrip() + "\n"


def _number_or_text(text: str) -> Any:
    """An override's value TOML cannot read: a number or a boolean as Python writes it (``.5``, ``5.``, ``010``,
    ``True``), else the text itself (a bare word, a path)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _spell_out_none(model: BaseModel, data: dict[str, Any]) -> None:
    """In ``data`` (``model``'s dump): each None value dropped where it is its field's default, else made "none"
    (TOML has no null: omitted, it would read back as the default)."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _spell_out_none(value, data[name])
        elif isinstance(value, tuple) and value and all(isinstance(v, BaseModel) for v in value):
            for item, dumped in zip(value, data[name]):
                _spell_out_none(item, dumped)
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for key, item in value.items():  # sections by name (model.kunlun.events)
                _spell_out_none(item, data[name][key])
        elif value is None:
            if field.default is None and field.default_factory is None:
                del data[name]
            else:
                data[name] = "none"


def _is_map(key: str) -> bool:
    # fields whose value is a free-form mapping rather than a config section
    return key in {"task_weights"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_key(key: str) -> str:
    """``key`` as TOML spells it: bare where it may be (letters, digits, ``_``, ``-``), else quoted (a task or an event
    type named by the data may hold anything)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)
