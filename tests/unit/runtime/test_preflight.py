"""Pre-flight without Ray: the cluster is the dict `ray.cluster_resources()` would return."""

from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.runtime.preflight import check_model_and_task as preflight_model
from streamrl.runtime.preflight import check_resume_overrides, preflight
from streamrl.runtime.supervision import producer_seed


def config(*overrides):
    return load_config(overrides=list(overrides))


def test_a_run_the_cluster_cannot_place_is_refused_with_the_arithmetic():
    with pytest.raises(ConfigError, match=r"reserves 9 CPUs .* the Ray cluster has 2"):
        preflight(config("producers.num_cpus=4"), {"CPU": 2.0})
    with pytest.raises(ConfigError, match=r"reserves 1 GPUs .* has 0"):
        preflight(config("trainer.num_gpus=1"), {"CPU": 8.0})


def test_the_plan_carries_the_models_vocabulary_and_the_trainers_concurrency():
    plan = preflight(config(), {"CPU": 2.0})
    assert plan.queue.vocab_size is not None and plan.queue.group_size == config().queue.group_size
    assert plan.trainer_ranks == 1 and not plan.trainer_sends_weights and plan.trainer_concurrency == 3
    assert plan.queue_restore is plan.trainer_resume is plan.trainer_model is None
    distributed = config("producers.engine=\"sglang\"", "producers.sglang.weights=\"distributed\"",
                         "producers.count=2")
    plan = preflight(distributed, {"CPU": 16.0, "GPU": 8.0})
    assert plan.trainer_sends_weights and plan.trainer_concurrency == 3 + 3 * 2
    assert plan.ready_timeout_s == 300 + distributed.producers.sglang.startup_timeout_s


def test_a_resumed_plan_starts_from_the_checkpoint(tmp_path: Path):
    plan = preflight(config(), {"CPU": 2.0}, resume_from=tmp_path / "step_000004")
    assert plan.queue_restore == str(tmp_path / "step_000004" / "queue")
    assert plan.trainer_model == str(tmp_path / "step_000004" / "trainer" / "model")


def test_a_resume_may_not_change_what_defines_the_data_or_the_model():
    with pytest.raises(ConfigError, match="queue.group_size cannot change"):
        check_resume_overrides(config(), config("queue.group_size=4"))
    check_resume_overrides(config(), config("run.steps=5000"))  # how long it runs may change


def test_a_resume_that_would_move_a_decaying_schedules_end_must_say_where_it_ends():
    """The decay's end defaults to run.steps × minibatches: extending a finished cosine run put its
    learning rate back up the curve, 5.5× at the end of a 100-step run resumed for 200 (outside review)."""
    cosine = ("trainer.lr_schedule=\"cosine\"", "run.steps=100")
    for moved in ("run.steps=200", "trainer.minibatches=2"):
        with pytest.raises(ConfigError, match=r"decays until optimizer step 100 .* move its end to 200 .* "
                                              r"Set trainer.lr_decay_steps: 100 keeps the schedule"):
            check_resume_overrides(config(*cosine), config(*cosine, moved))
    check_resume_overrides(config(*cosine), config(*cosine, "run.steps=200", "trainer.lr_decay_steps=100"))
    check_resume_overrides(config(*cosine), config(*cosine, "run.steps=200", "trainer.lr_decay_steps=200"))
    check_resume_overrides(config("run.steps=100"), config("run.steps=200"))  # constant: nothing moves
    explicit = (*cosine, "trainer.lr_decay_steps=80")
    check_resume_overrides(config(*explicit), config(*explicit, "run.steps=300"))  # its end was never the run's


def test_a_replacement_producer_draws_other_random_numbers_than_the_one_it_replaces():
    seeds = {producer_seed(0, pid, version, restart) for pid in range(3) for version in (0, 5)
             for restart in range(3)}
    assert len(seeds) == 18 and producer_seed(0, 1, 5, 2) == producer_seed(0, 1, 5, 2)


@pytest.mark.parametrize("architecture", ["gpt2", "nested"])
def test_the_models_context_and_depth_are_read_whatever_the_architecture_calls_them(tmp_path: Path, architecture):
    """GPT-2's config says `n_positions` and `n_layer`; a multimodal config nests them under `text_config`.
    Reading only `max_position_embeddings` at the top skipped both checks for such models."""
    from transformers import GPT2Config, LlavaConfig

    if architecture == "gpt2":
        GPT2Config(n_positions=32, n_layer=3, n_embd=16, n_head=2).save_pretrained(tmp_path)
    else:
        LlavaConfig(text_config={"model_type": "qwen2", "max_position_embeddings": 32, "num_hidden_layers": 3,
                                 "hidden_size": 16, "num_attention_heads": 2}).save_pretrained(tmp_path)
    model = f"model.path=\"{tmp_path}\""
    with pytest.raises(ConfigError, match="max_new_tokens=40 leaves no room for a prompt .* max_position_embeddings=32"):
        preflight_model(config(model, "task.kind=\"file\"", "task.prompts=\"p.jsonl\"", "task.reward=\"m:f\"",
                               "sampling.max_new_tokens=40"))
    with pytest.raises(ConfigError, match="pipeline_parallel=2 does not divide the model's 3 layers"):
        preflight_model(config(model, "trainer.backend=\"megatron\"", "trainer.pipeline_parallel=2"))


def test_a_model_the_engine_or_trainer_cannot_run_is_refused_before_anything_starts(tmp_path: Path, tiny_model_dir):
    """A sliding-window model ran on the torch engine until a second group joined the running batch,
    then failed the producer mid-run; the megatron trainer refused it only once its actors had started."""
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    fields = json.loads((model_dir / "config.json").read_text())

    def model(**changes):
        (model_dir / "config.json").write_text(json.dumps({**fields, **changes}))
        return f"model.path=\"{model_dir}\""

    windowed = model(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2)
    with pytest.raises(ConfigError, match=r"cannot run on producers.engine = 'torch': continuous batching needs a "
                                          r"plain KV cache; this model's has \['DynamicSlidingWindowLayer'\]"):
        preflight_model(config(windowed))
    sglang = ("producers.engine=\"sglang\"", "producers.num_gpus=1", "trainer.num_gpus=1")
    preflight_model(config(windowed, *sglang))  # sglang serves sliding-window models
    with pytest.raises(ConfigError, match="cannot train on trainer.backend = 'megatron': sliding-window attention"):
        preflight_model(config(windowed, *sglang, "trainer.backend=\"megatron\""))
    one_group = model(num_key_value_heads=1)
    preflight_model(config(one_group, "trainer.backend=\"megatron\""))
    with pytest.raises(ConfigError, match="megatron': tensor parallel size 2 does not divide key/value heads = 1"):
        preflight_model(config(one_group, "trainer.backend=\"megatron\"", "trainer.tensor_parallel=2"))


def test_a_model_config_transformers_cannot_read_is_refused_naming_the_directory(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")  # no model_type
    with pytest.raises(ConfigError, match=f"model.path '{tmp_path}': transformers cannot read its config.json"):
        preflight_model(config(f"model.path=\"{tmp_path}\""))


def test_a_reward_module_that_raises_as_it_is_imported_is_refused_as_config(tmp_path: Path, tiny_model_dir,
                                                                          monkeypatch):
    """A RuntimeError at import escaped the launch checks as a traceback: only ImportError was caught (review)."""
    (tmp_path / "raiser.py").write_text('raise RuntimeError("boom at import")\n')
    (tmp_path / "train.jsonl").write_text('{"prompt": "12>"}\n')
    monkeypatch.chdir(tmp_path)  # the launch directory: where a local reward module is imported from
    file_task = config(f"model.path=\"{tiny_model_dir}\"", "task.kind=\"file\"", "task.prompts=\"train.jsonl\"",
                       "task.reward=\"raiser:score\"", "sampling.max_new_tokens=8")
    with pytest.raises(ConfigError, match=r"task: reward 'raiser:score': importing module 'raiser' raised "
                                          r"RuntimeError: boom at import"):
        preflight_model(file_task)


@pytest.mark.parametrize("tokenizer_json, error", [('{"broken', "JSONDecodeError"),
                                                   ('{"model": {"type": "Nope"}}', "KeyError")])
@pytest.mark.parametrize("kind", ["reverse", "long_tail", "file"])
def test_a_tokenizer_transformers_cannot_load_is_refused_naming_the_model(tmp_path: Path, tiny_model_dir, kind,
                                                                          tokenizer_json, error):
    """A broken tokenizer.json escaped the launch checks as transformers' traceback (outside review)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "train.jsonl").write_text('{"prompt": "12>"}\n')
    file_task = ("task.prompts=\"train.jsonl\"", "task.reward=\"m:f\"", "sampling.max_new_tokens=8")
    broken = config(f"model.path=\"{model}\"", f"task.kind=\"{kind}\"", *(file_task if kind == "file" else ()))
    with pytest.raises(ConfigError, match=f"model.path '{model}': transformers cannot load its tokenizer \\({error}"):
        preflight_model(broken)
