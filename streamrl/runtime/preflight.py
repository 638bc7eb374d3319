"""Pre-flight: every check a run passes before an actor exists, and the plan the run is built from.

```
 prepare (before Ray, before the run directory is touched): resolve_paths, check_model_and_task,
                                                           check_resume_overrides on --resume
 preflight(config, cluster, resume_from) ─► Plan            the checks that need the cluster, and the
                                                           numbers every actor is created with
```
A refusal is a ConfigError that names the field; nothing has been created when it is raised, so the same
command can be fixed and run again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.buffer.checkpoint import MANIFEST
from streamrl.buffer.config import QueueConfig
from streamrl.config import ConfigError, RunConfig
from streamrl.rollout.producer import COMMIT_THREADS
from streamrl.runtime.rundir import RunDirError

QUEUE_PART = "queue"  # a checkpoint's queue: CHECKPOINT/queue/ (the trainer's in CHECKPOINT/trainer/)

# Fields a resumed run may not change: they define the data already generated and the model trained
# (run.seed draws each prompt id's prompt: changed, the prompts given back and the rest of the stream
# would be other prompts, some already trained on).
FROZEN_ON_RESUME = ("model", "task", "run.seed", "queue.group_size", "queue.groups_per_step", "trainer.backend",
                    "trainer.tensor_parallel", "trainer.pipeline_parallel")  # the optimizer state is saved per shard
# A producer's run; the queue's take_batch of each commit in flight; the trainer's offers; status; stop.
PRODUCER_CONCURRENCY = 4 + COMMIT_THREADS
READY_TIMEOUT_S = 300.0  # every actor's constructor (sglang producers add their servers' start-up)


def _section(config: RunConfig, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def frozen_settings(config: RunConfig) -> dict[str, Any]:
    """The FROZEN_ON_RESUME fields as JSON, recorded in each checkpoint's meta.json (checksummed)."""
    def plain(value: Any) -> Any:
        return value.model_dump(mode="json") if hasattr(value, "model_dump") else value

    return {field: plain(_section(config, field)) for field in FROZEN_ON_RESUME}


def check_checkpoint_settings(recorded: dict[str, Any], config: RunConfig, checkpoint: str) -> None:
    """The run's config.toml against what its checkpoint was written under: config.toml is a file a person
    can edit, and a frozen field changed there got past `check_resume_overrides` (which compares the two)."""
    now = frozen_settings(config)
    for field, value in recorded.items():
        if field in now and now[field] != value:
            raise ConfigError(f"{field} is {now[field]!r} in the run's config.toml, but checkpoint {checkpoint} was "
                              f"written with {value!r} (edited by hand?); it cannot change when resuming")


def check_saved_staleness(checkpoint: Path, config: RunConfig) -> None:
    """Under `queue.max_staleness = "auto"` the checkpoint's η must lie in [auto_min, auto_max]: the queue's
    restore refuses it otherwise, once Ray and every actor have started, and blames the checkpoint."""
    queue = config.queue
    manifest = checkpoint / QUEUE_PART / MANIFEST
    if not queue.auto or not manifest.is_file():  # none: the queue's restore names what is missing
        return
    try:  # its one field: the checkpoint's files were verified just before (`verified_checkpoint`)
        saved_eta = json.loads(manifest.read_text()).get("max_staleness")
    except (OSError, ValueError, AttributeError) as exc:
        raise RunDirError(f"{manifest}: unreadable ({exc})") from exc
    if saved_eta is not None and not queue.auto_min <= saved_eta <= queue.auto_max:
        raise ConfigError(f"checkpoint {checkpoint.name}'s queue holds max_staleness {saved_eta}, outside "
                          f"queue.auto_min / queue.auto_max = [{queue.auto_min}, {queue.auto_max}]: widen them "
                          "to include it")


def check_resume_overrides(saved: RunConfig, wanted: RunConfig) -> None:
    for field in FROZEN_ON_RESUME:
        if _section(saved, field) != _section(wanted, field):
            raise ConfigError(f"{field} cannot change when resuming (the run was started with "
                              f"{_section(saved, field)!r})")
    # A decay's end defaults to the run's length: extending a finished cosine run would, unasked, put its
    # learning rate back up the curve (5.5× at the end of a 100-step run resumed for 200). As megatron's
    # scheduler refuses a checkpoint's decay steps that differ from the arguments', the user says which.
    schedule = wanted.trainer.lr_schedule
    planned, now = (c.trainer.lr_decay_steps or c.optimizer_steps for c in (saved, wanted))
    if schedule != "constant" and wanted.trainer.lr_decay_steps is None and planned != now:
        raise ConfigError(f"trainer.lr_schedule = {schedule!r} decays until optimizer step {planned} (run.steps × "
                          f"trainer.minibatches of the run so far); these settings would move its end to {now} "
                          f"and the learning rate with it. Set trainer.lr_decay_steps: {planned} keeps the "
                          "schedule (steps after it run at lr × min_lr_ratio), another value re-plans it")


def model_facts(config: RunConfig) -> dict[str, Any]:
    """Vocabulary, context length and depth of the model at model.path, or of the built-in model."""
    if config.task.kind == "sim":
        return {"vocab_size": config.sim.vocab_size}  # no model: the simulator's tokens
    if config.model.path is None:
        from streamrl.tasks.reverse import CharVocab

        return {"vocab_size": len(CharVocab()), "max_position_embeddings": config.model.max_positions,
                "num_hidden_layers": config.model.num_layers}
    model_dir = Path(config.model.path).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path {str(model_dir)!r} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig

    # Through transformers, not the JSON's keys: GPT-2 spells the context `n_positions` and the depth
    # `n_layer` (its attribute map answers to the common names), multimodal models nest the language
    # model's fields under `text_config`.
    try:
        loaded = AutoConfig.from_pretrained(model_dir)
        text = loaded.get_text_config()
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.path {str(model_dir)!r}: transformers cannot read its config.json ({exc})") from exc
    facts = {key: getattr(text, key, None) for key in ("vocab_size", "max_position_embeddings", "num_hidden_layers")}
    return {**facts, "config": loaded}


def check_model_supported(config: RunConfig, model_config: Any) -> None:
    """What the chosen engine and trainer cannot run is refused now, not once they have started (the
    torch engine met a sliding-window cache at its first join into a running batch, mid-run)."""
    where = f"model.path {config.model.path!r}"
    if config.producers.engine == "torch":
        from streamrl.engine.torch_engine import check_plain_cache

        try:
            check_plain_cache(model_config)
        except ValueError as exc:
            raise ConfigError(f"{where} cannot run on producers.engine = 'torch': {exc}") from exc
    if config.trainer.backend == "megatron":
        from streamrl.megatron.convert import Layout

        try:
            Layout.from_hf(model_config).check_tp(config.trainer.tensor_parallel)
        except ValueError as exc:
            raise ConfigError(f"{where} cannot train on trainer.backend = 'megatron': {exc}") from exc


def load_tokenizer(config: RunConfig) -> Any:
    """The tokenizer of the model at model.path; one transformers cannot load is refused naming the directory."""
    from transformers import AutoTokenizer

    model_dir = Path(config.model.path).expanduser()
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 -- a broken file fails anywhere in transformers (JSONDecodeError, KeyError)
        raise ConfigError(f"model.path {str(model_dir)!r}: transformers cannot load its tokenizer "
                          f"({type(exc).__name__}: {exc})") from exc


def reward_dir(config: RunConfig) -> str:
    """Where the reward module is imported from: the run's recorded directory (a run started before
    task.reward_dir existed: the launch directory, as then)."""
    return config.task.reward_dir or os.getcwd()


def resolve_paths(config: RunConfig) -> RunConfig:
    """Relative paths are relative to the launch directory; actors run elsewhere, and a resumed run
    may start from another directory, so the resolved config holds absolute ones."""
    def absolute(value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())

    return config.model_copy(update={
        "run": config.run.model_copy(update={"output_dir": absolute(config.run.output_dir)}),
        "model": config.model.model_copy(update={"path": absolute(config.model.path)}),
        "task": config.task.model_copy(update={"prompts": absolute(config.task.prompts),
                                               "eval_prompts": absolute(config.task.eval_prompts),
                                               "reward_dir": absolute(config.task.reward_dir or (
                                                   os.getcwd() if config.task.reward else None))}),
    })


def check_model_and_task(config: RunConfig) -> None:
    """Cross-checks between the model's files and the task, before anything is created."""
    facts = model_facts(config)
    positions = facts.get("max_position_embeddings")
    layers, stages = facts.get("num_hidden_layers"), config.trainer.pipeline_parallel
    if layers is not None and layers % stages:
        raise ConfigError(f"trainer.pipeline_parallel={stages} does not divide the model's {layers} layers "
                          "(num_hidden_layers): every stage holds the same number of layers")
    if "config" in facts:
        check_model_supported(config, facts["config"])
    if config.task.kind == "file":
        from streamrl.tasks import make_task
        from streamrl.tasks.files import MAX_NEW_TOKENS

        # Room for a whole response: past the context a RoPE model decodes on without an error and learned
        # positions fail, and sglang refuses the request (prompt + max_new_tokens over its context length).
        response = config.sampling.max_new_tokens or MAX_NEW_TOKENS
        if positions is not None and response >= positions:
            raise ConfigError(f"sampling.max_new_tokens={response} leaves no room for a prompt in the model's "
                              f"max_position_embeddings={positions}")
        tokenizer = load_tokenizer(config)
        try:  # reads and tokenizes the prompt files, imports the reward function: errors name the file or function
            make_task(config.task, tokenizer, search_path=reward_dir(config),
                      max_prompt_tokens=None if positions is None else positions - response)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"task: {exc}") from exc
    kind = config.task.kind
    if kind in ("reverse", "long_tail") and config.model.path is not None:
        from streamrl.tasks.reverse import CharVocab

        ids = load_tokenizer(config).get_vocab()
        expected = {tok: i for i, tok in enumerate(CharVocab().tokens)}
        if any(ids.get(tok) != i for tok, i in expected.items()):
            raise ConfigError(f"task.kind = {kind!r} needs the character tokenizer streamrl builds "
                              f"(model.path {config.model.path!r} maps its characters to other ids)")
    if kind in ("reverse", "long_tail") and positions is not None:
        field, digits = ("digits", config.task.digits) if kind == "reverse" else ("max_digits", config.task.max_digits)
        longest = digits + 2 + (config.sampling.max_new_tokens or digits + 2)  # <bos> digits > | answer <eos>
        if longest > positions:
            raise ConfigError(f"task.{field}={digits}: sequences of up to {longest} tokens exceed the "
                              f"model's max_position_embeddings={positions}")


def check_resources(config: RunConfig, cluster: Mapping[str, float]) -> None:
    """Refuse a run the cluster (`ray.cluster_resources()`) cannot place: Ray would wait for it forever."""
    ranks = config.trainer.ranks
    for kind, field in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        wanted = ranks * getattr(config.trainer, field) + config.producers.count * getattr(config.producers, field)
        have = cluster.get(kind, 0)
        if wanted > have:
            raise ConfigError(f"the run reserves {wanted:g} {kind}s (trainer.tensor_parallel × data_parallel "
                              f"× pipeline_parallel × trainer.{field} + producers.count × producers.{field}) but "
                              f"the Ray cluster has {have:g}")


def trainer_sends_weights(config: RunConfig) -> bool:
    """The trainer's first rank broadcasts each version to the servers ("distributed" sglang weights)."""
    return (config.producers.engine, config.producers.sglang.weights) == ("sglang", "distributed")


@dataclass(frozen=True)
class Plan:
    """What the run's actors are created with, decided before the first of them exists."""

    queue: QueueConfig  # the run's queue config with the model's vocabulary (token ids outside it are refused)
    trainer_ranks: int  # TP × DP × PP rank actors (one: no placement group)
    trainer_concurrency: int  # a step, a cancel, producers subscribing, and each producer's broadcasts
    trainer_sends_weights: bool
    producer_concurrency: int
    ready_timeout_s: float
    queue_restore: str | None  # --resume: the checkpoint's queue, trainer state and trained model
    trainer_resume: str | None
    trainer_model: str | None  # None: the run's initial model


def preflight(config: RunConfig, cluster: Mapping[str, float], resume_from: Path | None = None) -> Plan:
    """The checks that need the cluster, and the plan. `cluster`: `ray.cluster_resources()`."""
    check_resources(config, cluster)
    sends = trainer_sends_weights(config)
    # one server at a time per producer: a broadcast, and the open or close that can overlap a failed one
    broadcasts = 3 * config.producers.count if sends else 0
    startup = config.producers.sglang.startup_timeout_s if config.producers.engine == "sglang" else 0
    return Plan(queue=config.queue.model_copy(update={"vocab_size": int(model_facts(config)["vocab_size"])}),
                trainer_ranks=config.trainer.ranks, trainer_concurrency=3 + broadcasts, trainer_sends_weights=sends,
                producer_concurrency=PRODUCER_CONCURRENCY, ready_timeout_s=READY_TIMEOUT_S + startup,
                queue_restore=str(resume_from / QUEUE_PART) if resume_from else None,
                trainer_resume=str(resume_from / "trainer") if resume_from else None,
                trainer_model=str(resume_from / "trainer" / "model") if resume_from else None)
