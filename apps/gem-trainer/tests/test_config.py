import pytest

from gem_trainer.config import DEFAULT_CONFIG, ConfigError, TrainerConfig, dump_config, load_config


def write(path, text):
    path.write_text(text)
    return path


def test_embedded_default_loads():
    config = load_config()
    assert isinstance(config, TrainerConfig)
    assert config.model.name == "kunlun" and config.model.kunlun.size == "tiny" and config.data.source == "synthetic"
    assert load_config(DEFAULT_CONFIG) == config


def test_unknown_key_names_file_and_dotted_path(tmp_path):
    path = write(tmp_path / "bad.toml", "[optimizer]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message == f"{path}: optimizer.learning_rate: unknown field"
    assert "\n" not in message


def test_wrong_type_names_field_and_value(tmp_path):
    path = write(tmp_path / "bad.toml", '[model.kunlun]\nd_model = "wide"\n')
    with pytest.raises(ConfigError, match=r"bad.toml: model.kunlun.d_model: .*integer.*'wide'") as error:
        load_config(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text, expected", [
    ('[optimizer]\nlr = "0.01"\n', r"bad\.toml: optimizer: lr takes a number, got '0\.01'$"),
    ('[[data.mixture.sources]]\nname = "a"\nweight = "2"\n', r"data\.mixture\.sources\.0: weight takes a number, got '2'$"),
    ('[[data.mixture.sources]]\nname = "a"\nonline = "yes"\n', r"data\.mixture\.sources\.0: online takes true or false, got 'yes'$"),
    ('[data.sequential]\ntime_split = ["0.7", 0.9]\n', r"data\.sequential: time_split takes numbers, got \['0\.7', 0\.9\]$"),
])
def test_text_where_a_number_or_a_switch_belongs_is_refused(tmp_path, text, expected):
    """pydantic would read "0.01" as 0.01 and "yes" as true: a quoted value is a mistake the user should hear of."""
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path / "bad.toml", text))


def test_soft_labels_and_the_loopfm_store_in_one_folder_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"loopfm\.store and distillation\.soft_labels name the same folder"):
        load_config(None, [f"--distillation.soft_labels={tmp_path / 'same'}", f"--loopfm.store={tmp_path}/./same"])


def test_a_switched_off_setting_reads_back_from_the_record(tmp_path):
    """TOML has no null: a None written as nothing read back as the field's default (grad_clip 1.0, max_history 50),
    so eval of a run with its recorded config used other settings, and every resume noted a change."""
    config = load_config(None, ["--optimizer.grad_clip=none", "--data.source=atomic", "--data.path=x",
                                "--data.sequential.max_history=none"])
    again = load_config(write(tmp_path / "record.toml", dump_config(config)))
    assert again == config and again.optimizer.grad_clip is None and again.data.sequential.max_history is None


def test_a_record_of_sections_by_name_with_defaults_and_keys_toml_must_quote_reads_back(tmp_path):
    """An event type's width defaults to none (the model's width), which TOML cannot write as it is; a task or event
    type named by the data may hold characters a bare TOML key cannot."""
    config = load_config(None, ["--model.kunlun.events={purchase = {num_layers = 1}}",
                                '--model.task_weights={"click rate" = 1.0}'])
    text = dump_config(config)
    assert '"click rate" = 1.0' in text and "[model.kunlun.events.purchase]" in text
    assert load_config(write(tmp_path / "record.toml", text)) == config


@pytest.mark.parametrize("text, value", [(".5", 0.5), ("5.", 5.0), ("2e-3", 0.002)])
def test_an_override_of_a_number_toml_cannot_read_is_the_number(text, value):
    assert load_config(None, [f"--optimizer.lr={text}"]).optimizer.lr == value
    assert load_config(None, ["--data.read_ahead=False"]).data.read_ahead is False  # Python's spelling


def test_nested_section_field_is_named(tmp_path):
    path = write(tmp_path / "bad.toml", "[data.synthetic]\nmax_events = -1\n")
    with pytest.raises(ConfigError, match=r"data.synthetic.max_events: .*greater than or equal to 1"):
        load_config(path)


def test_missing_base_names_the_inheriting_file(tmp_path):
    path = write(tmp_path / "child.toml", 'base = "nowhere.toml"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: base: config file not found: {tmp_path / 'nowhere.toml'}"


def test_inheritance_cycle_is_reported(tmp_path):
    write(tmp_path / "a.toml", 'base = "b.toml"\n')
    write(tmp_path / "b.toml", 'base = "a.toml"\n')
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(tmp_path / "a.toml")


def test_base_values_are_overridden_section_by_section(tmp_path):
    write(tmp_path / "base.toml", "seed = 7\n[optimizer]\nlr = 0.5\nweight_decay = 0.1\n")
    child = write(tmp_path / "child.toml", 'base = "base.toml"\n[optimizer]\nlr = 0.25\n')
    config = load_config(child)
    assert (config.seed, config.optimizer.lr, config.optimizer.weight_decay) == (7, 0.25, 0.1)


def test_command_line_overrides(tmp_path):
    config = load_config(None, ["--optimizer.lr=3e-4", "--model.kunlun.hidden=[64, 32]", "--run_dir=/tmp/x", "--device=cpu"])
    assert config.optimizer.lr == 3e-4 and config.model.kunlun.hidden == (64, 32) and config.run_dir == "/tmp/x"
    assert config.model.kunlun.build().hidden == (64, 32)
    with pytest.raises(ConfigError, match=r"optimizer.lrr: unknown field"):
        load_config(None, ["--optimizer.lrr=1"])
    with pytest.raises(ConfigError, match="expected --section.field=value"):
        load_config(None, ["--optimizer.lr"])


def test_cross_field_checks(tmp_path):
    with pytest.raises(ConfigError, match="warmup_steps .* must be below schedule.steps"):
        load_config(None, ["--schedule.steps=10", "--schedule.warmup_steps=10"])
    with pytest.raises(ConfigError, match="model.kunlun: .*d_model .* divisible by num_heads"):
        load_config(None, ["--model.kunlun.d_model=30", "--model.kunlun.num_heads=4"])
    with pytest.raises(ConfigError, match="model.kunlun: .*skip\\[0\\] names unknown components"):
        load_config(None, ['--model.kunlun.skip=[["ffn"]]'])
    with pytest.raises(ConfigError, match="data.synthetic.user_propensity needs data.synthetic.num_users"):
        load_config(None, ["--data.synthetic.user_propensity=0.5"])


def test_invalid_toml_is_reported_with_the_file(tmp_path):
    path = write(tmp_path / "broken.toml", "[model\n")
    with pytest.raises(ConfigError, match="broken.toml: invalid TOML"):
        load_config(path)


def test_printed_config_loads_back_to_the_same_config(tmp_path):
    config = load_config(
        None,
        [
            "--model.task_weights={click = 1.0, conversion = 0.5}",
            "--metrics.peak_tflops=10.0",
            '--model.kunlun.skip=[[], ["attention"]]',
            "--model.kunlun.events={purchase = {width = 16, num_layers = 1}}",
        ],
    )
    path = write(tmp_path / "resolved.toml", dump_config(config))
    assert load_config(path) == config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.name=kunlun"], r"objective = \"retrieval\" needs model.name = \"sasrec\" or a Kunlun with model.kunlun.two_tower"),
        (["--model.name=kunlun", "--model.kunlun.two_tower=true"], r"queries = \"every\" needs a causal model"),
        (["--data.sequential.max_history=80"], r"max_history \(80\) must not exceed model.sasrec.max_seq_len \(50\)"),
        (["--data.sequential.num_negatives=0"], r"num_negatives must be >= 1 for loss = \"binary\""),
        (["--data.source=synthetic"], r"data\.sequential\.objective applies to next-item data"),
        (["--model.name=baseline", "--model.kunlun.two_tower=true"], r"two_tower applies to model.name = \"kunlun\""),
        (["--model.name=domain_experts", "--model.kunlun.dropout=0.1", "--model.kunlun.contrastive_weight=0.1"],
         r"contrastive_weight applies to model.name = \"kunlun\", not 'domain_experts'"),
    ],
)
def test_retrieval_objective_needs_a_model_that_can_answer_it(tmp_path, overrides, message):
    path = write(tmp_path / "r.toml", '[model]\nname = "sasrec"\n[data]\nsource = "sequence_text"\npath = "x.txt"\n'
                 '[data.sequential]\nobjective = "retrieval"\nqueries = "every"\n')
    assert load_config(path).data.sequential.queries == "every"
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["--model.kunlun.hidden=[0]"], r"model\.kunlun: hidden widths must be >= 1, got \[0\]"),  # a constant output
    (["--model.baseline.hidden=[64, -3]"], r"model\.baseline: hidden widths must be >= 1, got \[64, -3\]"),
    (["--model.interformer.hidden=[0]"], r"model\.interformer: hidden widths must be >= 1"),
    (["--model.domain_experts.num_shared=0", "--model.domain_experts.num_specific=0"],
     r"model\.domain_experts: at least one expert is needed: num_shared \+ num_specific >= 1"),
    (["--data.read_ahead=1"], r"data: read_ahead takes true or false, got 1"),
    (["--data.synthetic.seed=-1"], r"data\.synthetic\.seed: Input should be greater than or equal to 0"),
    (["--data.balance_window=8"], r"data\.balance_window applies to data\.balance = true"),
    (["--data.sequential.with_user_id=true"], r"data\.sequential\.with_user_id applies to next-item data \(sequence_text, "
                                              r"atomic\), which no source reads \(\['synthetic'\]\)"),
    (["--data.source=atomic", "--data.path=x", "--data.synthetic.num_surfaces=7"],
     r"data\.synthetic\.num_surfaces applies to synthetic data, which no source reads \(\['atomic'\]\)"),
    (["--data.eval_path=/nowhere"], r"data\.eval_path names held-out parquet files, but no source reads parquet"),
    (["--data.source=atomic", "--data.path=x", "--data.sequential.attributes_file=a.json"],
     r"data\.sequential\.attributes_file applies to sequence_text data, which no source reads \(\['atomic'\]\)"),
    (['--data.mixture.sources=[{name = "a", path = "/x"}]'], r"data\.mixture\.sources\.a\.path: a synthetic source reads no file"),
    (["--data.source=atomic", "--data.path=x", '--data.mixture.sources=[{name = "a", eval_path = "/x"}]'],
     r"data\.mixture\.sources\.a\.eval_path: held-out parquet files, but the source reads atomic data"),
    (['--data.mixture.sources=[{name = ""}]'], r"data\.mixture\.sources\.0\.name: String should match pattern"),
    (['--data.mixture.sources=[{name = "a", weight = 1e308}, {name = "b", weight = 1e308, seed = 1}]'],
     r"data\.mixture\.sources: the weights' sum must be finite"),
    (["--data.sequential.eval_protocols=[]"], r"data\.sequential\.eval_protocols: Tuple should have at least 1 item"),
    (['--data.sequential.eval_protocols=["sampled", "sampled"]'], r"data\.sequential\.eval_protocols lists a value twice"),
    (["--data.sequential.eval_seeds=[0, 1, 0]"], r"data\.sequential\.eval_seeds lists a value twice: \[0, 1, 0\]"),
    (["--data.source=atomic", "--data.path=x", "--data.sequential.eval_negatives=3"],
     r"data\.sequential\.eval_negatives \(3\) ranks each target among 4 candidates: the sampled protocol's HR@10 would "
     r"count every target a hit whatever the model; set it to at least 10"),
])
def test_settings_that_would_crash_mislead_or_be_dropped_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value)


def test_a_run_dir_that_is_a_file_and_a_config_file_that_is_not_text_are_one_line_errors(tmp_path):
    taken = write(tmp_path / "taken", "")
    with pytest.raises(ConfigError, match=rf"run_dir: {taken} is a file, not a folder$"):
        load_config(None, [f"--run_dir={taken}"])
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe seed = 1\n")
    with pytest.raises(ConfigError, match=rf"^{binary}: not a UTF-8 text file \(invalid start byte at byte 0\)$"):
        load_config(binary)


def test_errors_name_the_override_or_the_base_file_that_set_the_value(tmp_path):
    base = write(tmp_path / "base.toml", "[optimizer]\nlr = -1.0\n")
    child = write(tmp_path / "child.toml", 'base = "base.toml"\n[schedule]\nsteps = 10\nwarmup_steps = 1\n')
    with pytest.raises(ConfigError) as error:
        load_config(child)
    assert str(error.value).startswith(f"{base}: optimizer.lr: ")
    with pytest.raises(ConfigError) as error:
        load_config(child, ["--optimizer.lr=1e-3", "--schedule.steps=zero"])
    assert str(error.value).startswith("override --schedule.steps=zero: schedule.steps: ")
    # a value from the child file is blamed on the child
    bad_child = write(tmp_path / "bad_child.toml", 'base = "base.toml"\n[optimizer]\nlr = 0.1\nbetas = "x"\n')
    with pytest.raises(ConfigError) as error:
        load_config(bad_child)
    assert str(error.value).startswith(f"{bad_child}: optimizer.betas: ")
    # a check across sections blames the override of a field it names, not the last override given
    with pytest.raises(ConfigError) as error:
        load_config(child, ["--optimizer.lr=1e-3", "--schedule.warmup_steps=20", "--metrics.log_every=5"])
    assert str(error.value) == ("override --schedule.warmup_steps=20: schedule.warmup_steps (20) must be below "
                                "schedule.steps (10): a shorter run sets both, e.g. --schedule.warmup_steps=1")
    with pytest.raises(ConfigError) as error:  # no override of a field it names: the config file
        load_config(write(tmp_path / "late.toml", 'base = "base.toml"\n[optimizer]\nlr = 0.1\n[schedule]\nsteps = 5\n'
                                                  'warmup_steps = 9\n'), ["--metrics.log_every=5"])
    assert str(error.value).startswith(f"{tmp_path / 'late.toml'}: schedule.warmup_steps (9)")


def test_optional_fields_can_be_switched_off_with_none():
    assert load_config(None, ["--optimizer.grad_clip=none"]).optimizer.grad_clip is None
    assert load_config(None, ["--eval.every_steps=None"]).eval.every_steps is None
    with pytest.raises(ConfigError, match="schedule.steps"):
        load_config(None, ["--schedule.steps=none"])  # not optional: "none" is a bad value, not a switch


def test_every_model_name_has_a_builder_and_every_model_field_a_section_field():
    import dataclasses
    import typing

    from gem_kunlun import KunlunConfig, SasrecConfig
    from gem_trainer.builders import MODELS
    from gem_trainer.config import ModelConfig

    assert set(MODELS) == set(typing.get_args(ModelConfig.model_fields["name"].annotation))
    # sections are generated from the model dataclasses: nothing to keep in step by hand
    assert {f.name for f in dataclasses.fields(KunlunConfig)} | {"size"} == set(ModelConfig.model_fields["kunlun"].annotation.model_fields)
    assert {f.name for f in dataclasses.fields(SasrecConfig)} == set(ModelConfig.model_fields["sasrec"].annotation.model_fields)


@pytest.mark.parametrize("overrides,expected", [
    ([], "bfloat16"),
    (["--model.kunlun.fp32_residual=true"], None),  # a float32 history reads float32 vectors
    (["--precision.autocast=off"], None),
    (["--model.name=baseline"], None),
    (["--model.kunlun.two_tower=true", "--model.kunlun.share_item_table=true", "--data.source=sequence_text",
      "--data.path=x.txt", "--data.sequential.objective=retrieval"], None),  # an item tower pools the same tables
    (["--device=cpu"], None),  # fbgemm's CPU lookup writes float32 only
])
def test_sequence_lookups_return_autocasts_dtype_only_to_a_history_computed_in_it(overrides, expected):
    import torch

    from gem_trainer.builders import sequence_lookup_dtype

    config = load_config(None, ["--precision.autocast=bf16", *overrides])
    device = torch.device("cpu" if "--device=cpu" in overrides else "cuda")
    assert sequence_lookup_dtype(config, device) == (None if expected is None else getattr(torch, expected))


@pytest.mark.parametrize("overrides,device,world,expected", [
    ([], "cuda", 1, True),
    ([], "cpu", 1, False),
    ([], "cuda", 2, False),  # FSDP's experts unit would sit inside the compiled MoE
    (["--parallelism.compile=default"], "cuda", 1, False),  # the compiled blocks hold their MoEs
    (["--parallelism.param_dtype=bfloat16"], "cuda", 1, False),
    (["--parallelism.compile_experts=on"], "cpu", 1, True),
    (["--parallelism.compile_experts=off"], "cuda", 1, False),
    (["--parallelism.cuda_graphs=true"], "cuda", 1, False),  # replayed as CUDA graphs instead
])
def test_each_moe_is_compiled_alone_on_one_gpu_with_eager_blocks_unless_set(overrides, device, world, expected):
    import torch

    from gem_trainer.builders import compile_experts

    assert compile_experts(load_config(None, overrides), torch.device(device), world) is expected


def test_compiled_experts_in_compiled_blocks_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="compile_experts = \"on\" compiles the MoEs of blocks left eager"):
        load_config(None, ["--parallelism.compile_experts=on", "--parallelism.compile=default"])


@pytest.mark.parametrize("overrides", [["--parallelism.compile_experts=on"], ["--parallelism.compile=default"],
                                       ["--parallelism.activation_checkpointing=true"]])
def test_cuda_graphs_with_compiled_parts_are_refused_in_one_line(overrides):
    with pytest.raises(ConfigError, match="cuda_graphs replays eager layers' parts as CUDA graphs"):
        load_config(None, ["--parallelism.cuda_graphs=true", *overrides])


def test_padded_expert_messages_without_expert_parallelism_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="expert_padded sizes the all-to-all of expert parallelism: it needs expert > 1"):
        load_config(None, ["--parallelism.expert_padded=true"])
    assert load_config(None, ["--parallelism.expert_padded=true", "--parallelism.expert=2"])


@pytest.mark.parametrize("world_size,sparse_group", [(1, -1), (4, -1), (4, 4)])
def test_replica_averaging_without_table_replicas_is_refused_in_one_line(world_size, sparse_group):
    import torch

    from gem_trainer.builders import build_parallel_dims
    from gem_trainer.distributed import DistributedEnv

    config = load_config(None, ["--parallelism.sparse_sync_every=4", f"--parallelism.sparse_group={sparse_group}"])
    env = DistributedEnv(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), local_world_size=world_size)
    with pytest.raises(ConfigError, match=rf"^parallelism\.sparse_sync_every averages the table replicas of 2-D sparse "
                                          rf"parallelism, which this run has none of: it needs a sparse_group below the "
                                          rf"{world_size} ranks$"):
        build_parallel_dims(config, env)
    replicated = load_config(None, ["--parallelism.sparse_sync_every=4", "--parallelism.sparse_group=2"])
    assert build_parallel_dims(replicated, DistributedEnv(0, 4, 0, torch.device("cpu"), 4)).sparse_2d


def test_a_history_bucket_without_cuda_graphs_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="cuda_graph_history_bucket pads the history for a CUDA graph of the trunk"):
        load_config(None, ["--parallelism.cuda_graph_history_bucket=256"])
    with pytest.raises(ConfigError, match="cuda_graph_history_bucket"):
        load_config(None, ["--parallelism.cuda_graphs=on", "--parallelism.cuda_graph_history_bucket=-1"])
    assert load_config(None, ["--parallelism.cuda_graphs=auto", "--parallelism.cuda_graph_history_bucket=256"])


@pytest.mark.parametrize("overrides,device,world,expected", [
    (["--parallelism.cuda_graphs=auto"], "cuda", 1, True),
    (["--parallelism.cuda_graphs=auto"], "cpu", 1, False),
    (["--parallelism.cuda_graphs=auto"], "cuda", 2, False),  # a graph cannot hold FSDP's collectives
    (["--parallelism.cuda_graphs=auto", "--parallelism.compile=default"], "cuda", 1, False),
    (["--parallelism.cuda_graphs=auto", "--parallelism.compile_experts=on"], "cuda", 1, False),
    (["--parallelism.cuda_graphs=auto", "--parallelism.param_dtype=bfloat16"], "cuda", 1, False),
    (["--parallelism.cuda_graphs=auto", "--parallelism.activation_checkpointing=true"], "cuda", 1, False),
    (["--parallelism.cuda_graphs=auto", "--model.kunlun.capacity_factor=0"], "cuda", 1, False),  # a host-sized MoE
    (["--parallelism.cuda_graphs=true"], "cpu", 1, True),  # set: the layers then run eagerly off the GPU
    ([], "cuda", 1, False),
])
def test_cuda_graphs_auto_replays_on_one_gpu_where_nothing_is_compiled(overrides, device, world, expected):
    import torch

    from gem_trainer.builders import compile_experts, cuda_graphs

    config = load_config(None, overrides)
    assert cuda_graphs(config, torch.device(device), world) is expected
    if expected:  # the MoEs are replayed, not compiled
        assert not compile_experts(config, torch.device(device), world)


@pytest.mark.parametrize("override, message", [
    ("--data.batch_size=true", r"data: batch_size takes a number, got True"),
    ("--data.sequential.popularity_power=nan", r"data.sequential.popularity_power: Input should be a finite number"),
    ('--data.mixture.sources=[{name = "a", weight = inf}]', r"data.mixture.sources.0.weight: Input should be a finite number"),
    ("--data.sequential.eval_seeds=[]", r"data.sequential.eval_seeds: Tuple should have at least 1 item"),
])
def test_values_that_pass_a_bound_but_mean_nothing_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=f"override {override[:20]}.*{message}") as error:
        load_config(None, [override])
    assert "\n" not in str(error.value)


def test_two_synthetic_sources_reading_one_stream_are_refused_in_one_line():
    """Both would read the same examples (the generator's stream is the source's seed)."""
    sources = '--data.mixture.sources=[{name = "offline"}, {name = "online", online = true}]'
    with pytest.raises(ConfigError, match=r"data\.mixture\.sources\.online\.seed: 0, as source 'offline': both would read "
                                          r"the generator's stream 0, the same examples \(give each its own seed\)$"):
        load_config(None, [sources])
    load_config(None, ['--data.mixture.sources=[{name = "offline"}, {name = "online", online = true, seed = 1}]'])


@pytest.mark.parametrize("overrides,field", [(["--distillation.weight=4"], "distillation.weight"),
                                             (["--distillation.temperature=3"], "distillation.temperature"),
                                             (["--distillation.teacher_step=5"], "distillation.teacher_step"),
                                             (["--loopfm.key_only=true"], "loopfm.key_only")])
def test_transfer_settings_without_a_teacher_or_store_are_refused_in_one_line(overrides, field):
    """A student trained without its teacher (or store) would be reported as distilled."""
    with pytest.raises(ConfigError, match=rf"{field} (applies to|picks)"):
        load_config(None, overrides)
    assert load_config(None, [*overrides, "--distillation.soft_labels=labels", "--loopfm.store=memory",
                              "--distillation.teacher_run_dir=teacher"])


@pytest.mark.parametrize("override, message", [
    ("--run_dir=", "run_dir: String should match pattern"),
    ("--run_dir=  ", "run_dir: String should match pattern"),
    ("--seed=1733420000", "seed: Input should be less than 16777216"),
    ("--optimizer.betas=[1.5, 0.9]", "optimizer.betas.0: Input should be less than 1"),
    ("--model.task_weights={click = -1.0}", "model.task_weights.click: Input should be greater than or equal to 0"),
])
def test_values_that_would_fail_later_or_mislead_are_refused_in_one_line(override, message):
    """A blank run_dir (checkpoints at the filesystem's root), a seed past what the streams fold into 64-bit seeds,
    betas outside [0, 1), a negative task weight (the loss of that task maximised)."""
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as error:
        load_config(None, [override])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("weights, message", [
    ("{nosuch = 1.0}", r"model.task_weights names unknown tasks \['nosuch'\]"),
    ("{click = 0.0, conversion = 0.0}", "gives every task .* weight 0"),
])
def test_task_weights_the_data_cannot_take_are_config_errors(weights, message):
    from gem_trainer.distributed import init_distributed
    from gem_trainer.trainer import Trainer

    config = load_config(None, ["--device=cpu", "--metrics.tensorboard=false", "--data.batch_size=16",
                                "--data.synthetic.max_events=8", f"--model.task_weights={weights}"])
    with pytest.raises(ConfigError, match=message):
        Trainer(config, init_distributed("cpu", "gloo"))
