import pytest

from streamrl.config import ConfigError, RunConfig, apply_overrides, config_from_dict, dump_config, load_config


def test_default_config_is_the_builtin_cpu_run():
    config = load_config()
    assert config.task.kind == "reverse" and config.model.path is None
    assert config.trainer.backend == "torch" and config.producers.engine == "torch"
    assert config.loss.name == "decoupled_ppo"


def test_overrides_are_typed_and_nested():
    config = load_config(overrides=["queue.max_staleness=0", "trainer.lr=1e-3", "run.name=abc",
                                    "trainer.betas=[0.8, 0.9]", "logging.wandb=true", "run.time_limit_s=12.5", "ray.num_cpus=null"])
    assert config.queue.max_staleness == 0 and config.trainer.lr == 1e-3 and config.run.name == "abc"
    assert config.trainer.betas == (0.8, 0.9) and config.logging.wandb is True and config.run.time_limit_s == 12.5
    assert config.ray.num_cpus is None and load_config(overrides=["run.time_limit_s=null"]).run.time_limit_s is None


def test_toml_file_plus_overrides_and_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[queue]\ngroup_size = 4\ngroups_per_step = 8\n[run]\nsteps = 7\n')
    config = load_config(path, ["run.steps=9"])
    assert config.queue.group_size == 4 and config.run.steps == 9
    again = tmp_path / "again.toml"
    again.write_text(dump_config(config))
    assert load_config(again) == config


@pytest.mark.parametrize("no_limit", ["null", "0"])
def test_no_time_limit_survives_the_round_trip_through_config_toml(tmp_path, no_limit):
    config = load_config(overrides=[f"run.time_limit_s={no_limit}"])
    assert config.run.time_limit_s is None
    saved = tmp_path / "config.toml"
    saved.write_text(dump_config(config))  # TOML has no null: left out, it read back as the 200 s default
    assert load_config(saved).run.time_limit_s is None and load_config(saved) == config


SIM = ["producers.engine=sim", "trainer.backend=sim", "task.kind=sim"]


@pytest.mark.parametrize("overrides, message", [
    (["queue.max_staleness=-1"], r"queue\.max_staleness: Input should be an integer >= 0, or \"auto\" \(got -1\)"),
    (["trainer.lr=fast"], r"trainer\.lr: .*valid number.*\(got 'fast'\)"),
    (["trainer.lrr=0.1"], r"trainer\.lrr: Extra inputs are not permitted"),
    (["loss.name=ppo"], r"loss\.name: Input should be 'decoupled_ppo', 'ppo_bypass'"),
    (["task.kind=file"], r"task.kind = 'file' needs task\.prompts and task\.reward"),
    (["queue.group_size=1"], r"group advantages need at least 2 samples"),
    (["sampling.top_p=0.7"], r"sampling.top_p=0.7: the trainer's log-probs are of the whole distribution"),
    (["queue.group_size=1", "trainer.advantage=\"drgrpo\""], r"group advantages need at least 2 samples"),
    (["trainer.colocated=true"], r"trainer\.colocated = true needs producers\.engine = 'sglang' with"),
    (["producers.engine=sglang", "producers.num_gpus=1", "producers.sglang.servers=2"],
     r"producers\.num_gpus=1 is fewer than the 2 GPUs its sglang servers use"),
    (["trainer.tensor_parallel=2"], r"trainer\.tensor_parallel=2 needs trainer\.backend = 'megatron'"),
    (["producers.engine=sglang", "producers.num_gpus=1", "producers.sglang.weights=distributed"],
     r"producers\.sglang\.weights = 'distributed' with servers on GPUs needs trainer\.num_gpus >= 1"),
    (["producers.engine=sglang", "producers.sglang.memory_saver=true", "trainer.colocated=true",
      "producers.sglang.weights=distributed"], r"sends from the trainer's GPU, which trainer\.colocated = true"),
    (["producers.sglang.mem_fraction=1.5"], r"producers\.sglang\.mem_fraction: Input should be less than or equal to 1"),
    (["trainer.minibatches=33"], r"trainer\.minibatches=33 is more than queue\.groups_per_step=32"),
    (["trainer.minibatches=0"], r"trainer\.minibatches: Input should be greater than or equal to 1"),
    (["model.hidden_size=130"], r"hidden_size=130 is not divisible by num_heads=4"),
    (["run.name=bad name!"], r"run\.name: String should match pattern"),
    (["queue.max_staleness=0", "queue.max_in_flight=2"], r"a synchronous step could never be filled"),
    (["task.system_prompt=Be brief."], r"task\.system_prompt is put in by the chat template: set task\.chat_template"),
    (["model.dtype=float16"], r"model\.dtype: Input should be 'float32' or 'bfloat16'"),
    (["model.dtype=bfloat16", "trainer.backend=megatron"], r"the megatron trainer trains in float32 only"),
    (["model.attention=flash_attention_2", "model.dtype=bfloat16"], r"needs the flash-attn package"),
    # outside review: each of these passed the config and failed only once the actors ran
    (["model.hidden_size=24", "model.num_heads=8"],
     r"hidden_size=24 / num_heads=8 is a head size of 3: .* need an even head size"),
    ([*SIM, "sim.sequences_per_producer=2", "queue.group_size=4"],
     r"sim\.sequences_per_producer=2 cannot hold one group of queue\.group_size=4"),
    (["task.kind=long_tail", "task.digits=12", "task.max_digits=5"],
     r"task: .*kind = 'long_tail' with digits=12 above max_digits=5"),
    (["run.name=nan"], r"run\.name: nan reads as a number .* quote it to make it a string \(--set 'run\.name=\"nan\"'\)"),
    (["producers.sglang.extra_args=[\"--x\", inf]"], r"extra_args\.1: inf reads as a number .* \(\"inf\"\)"),
    (["run.steps=nan"], r"run\.steps: nan is not a finite number$"),
    # outside review: these reached Ray's client, which raised ValueError (a traceback) or waited on the port
    (['ray.address="http://127.0.0.1:8265"'], r"ray\.address: .*not a Ray cluster address: 'http://127\.0\.0\.1:8265'"),
    (['ray.address="127.0.0.1:notaport"'], r"ray\.address: .*its port 'notaport' is not a number from 1 to 65535"),
    (['ray.address="127.0.0.1:99999"'], r"ray\.address: .*its port '99999' is not a number"),
    (['ray.address=""'], r"ray\.address: .*not a Ray cluster address: ''"),
    (["ray.address='::1:6379'"], r"ray\.address: .*an IPv6 host goes in brackets: \[::1\]:6379"),
    (["ray.address='auto'", "ray.num_cpus=2"], r"ray\.num_cpus = 2 sizes a local Ray instance; with ray\.address"),
    (["sampling.temperature=1e-40"], r"sampling\.temperature: Input should be greater than or equal to 0\.001"),
    (["producers.weight_poll_s=61"], r"producers\.weight_poll_s: Input should be less than or equal to 60"),
    (["queue.ticket_timeout_s=1e10"], r"queue\.ticket_timeout_s: Input should be less than or equal to 31536000"),
])
def test_bad_values_name_the_field_and_the_value(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_the_limits_of_those_checks_are_accepted():
    assert load_config(overrides=["model.hidden_size=24", "model.num_heads=4"]).model.num_heads == 4  # head size 6
    assert load_config(overrides=[*SIM, "sim.sequences_per_producer=4", "queue.group_size=4"]).sim.sequences_per_producer == 4
    assert load_config(overrides=["task.kind=long_tail", "task.digits=5", "task.max_digits=5"]).task.digits == 5
    assert load_config(overrides=["task.digits=12", "task.max_digits=5"]).task.digits == 12  # reverse: max unused
    assert load_config(overrides=['run.name="nan"']).run.name == "nan"
    for address in ("auto", "10.0.0.2:6379", "ray://head:10001", "[::1]:6379", "localhost:65535"):
        assert load_config(overrides=[f"ray.address={address!r}"]).ray.address == address


@pytest.mark.parametrize("item", ["novalue", "=3", "run.steps.x=3"])
def test_malformed_overrides_are_rejected(item):
    with pytest.raises(ConfigError):
        load_config(overrides=[item])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_apply_overrides_does_not_mutate_its_input():
    tree = {"run": {"steps": 3}}
    assert apply_overrides(tree, ["run.steps=4"]) == {"run": {"steps": 4}} and tree == {"run": {"steps": 3}}
    assert config_from_dict({}) == RunConfig()


from checkout import LAUNCH  # noqa: E402  (tests/ is on the path: pyproject.toml)


@pytest.mark.parametrize("name", ["default", "sync", "one-step", "cpu-large", "cluster", "gpu-split", "sim",
                                  "gpu-cluster", "gpu-colocated", "long-tail", "../examples/own_task/config",
                                  "../examples/math_long_tail/config", "../examples/gpu/one_gpu_colocated",
                                  "../examples/gpu/eight_gpus_split"])
def test_example_configs_load(name):
    config = load_config(LAUNCH / f"{name}.toml")
    if name == "default":
        assert config == RunConfig()
    if name == "sync":
        assert config.queue.max_staleness == 0
    if name == "one-step":
        assert config.queue.max_staleness == 1 and config.queue.admission == "per_step"


def test_a_queue_table_that_sets_one_field_keeps_the_runs_defaults_for_the_others(tmp_path):
    """It fell back to QueueConfig's own defaults: setting capacity_tokens moved η from 2 to 1."""
    path = tmp_path / "run.toml"
    path.write_text("[queue]\ncapacity_tokens = 4000000\n")
    expected = RunConfig().queue.model_copy(update={"capacity_tokens": 4_000_000})
    assert load_config(path).queue == expected and RunConfig().queue.max_staleness == 2
    assert config_from_dict({"queue": {"capacity_tokens": 4_000_000}}).queue == expected
