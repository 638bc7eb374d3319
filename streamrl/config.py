"""The run configuration: one typed tree, loaded from TOML, overridden with `--set section.key=value`.

Every component reads its own section; cross-component constraints are checked once, here, before
any actor starts (`RunConfig._consistent`). An error names the field, the bad value and what is
allowed. The resolved tree is written to the run directory as `config.toml`, and a resumed run
reads it back from there.
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import json
import math
import tomllib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from streamrl.buffer.config import LONGEST_WAIT_S, QueueConfig
from streamrl.correction.config import LossConfig
from streamrl.net import cluster_address_problem
from streamrl.sim.workload import SimSection, SimWorkload


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RunSection(_Section):
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Names the run's actors (`NAME/queue`, ...) and its directory; default: task + start time."""
    output_dir: str = "runs"
    """Run directories are created under this folder."""
    seed: int = Field(0, ge=0)
    steps: int = Field(900, ge=1)
    """Trainer steps (optimizer updates) to take; the run also stops at `time_limit_s`."""
    time_limit_s: float | None = Field(200.0, gt=0, le=LONGEST_WAIT_S)
    """Stop training after this many seconds (Ray and model start-up not counted); 0 or null: no limit."""

    @field_validator("time_limit_s", mode="before")
    @classmethod
    def _zero_is_no_limit(cls, value: Any) -> Any:
        return None if value == 0 and not isinstance(value, bool) else value

    @field_serializer("time_limit_s")
    def _no_limit_as_zero(self, value: float | None) -> float:
        # Written as 0, which reads back as None: TOML has no null, and left out it would read back as 200 s.
        return 0.0 if value is None else value
    eval_every: int = Field(50, ge=0)
    """Evaluate on the held-out split every this many steps, and at the start and end (0: start and end only)."""
    checkpoint_every: int = Field(200, ge=0)
    """Write a checkpoint every this many steps (0: only at the end); one is always written at the end."""
    keep_checkpoints: int = Field(2, ge=1)
    """Older step checkpoints are deleted once this many newer ones exist."""


class ModelSection(_Section):
    path: str | None = None
    """A local Hugging Face model directory (config + safetensors + tokenizer). None: build the
    built-in tiny model (a Qwen2 architecture) for the built-in task, in the run directory."""
    hidden_size: int = Field(64, ge=8)
    """Built-in model only, like the four fields below."""
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(256, ge=8)
    max_positions: int = Field(64, ge=8)
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute precision of the torch sampler and the torch trainer. bfloat16: the sampler holds its
    weights in bf16; the trainer keeps float32 weights and optimizer state and runs its forward and
    backward under bf16 autocast. Log-probs are float32 either way. float16 is not offered: it needs
    loss scaling, which the trainer does not do (use bfloat16). sglang servers take `--dtype` in
    `producers.sglang.extra_args`."""
    attention: Literal["eager", "sdpa", "flash_attention_2"] = "eager"
    """The Hugging Face attention kernel (sampler and torch trainer): eager is fastest for small models
    on CPU; sdpa for larger ones; flash_attention_2 needs the flash-attn package, a GPU and bfloat16."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSection:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        head = self.hidden_size // self.num_heads
        if head % 2:  # rotary position embeddings turn each head's dimensions in pairs
            raise ValueError(f"hidden_size={self.hidden_size} / num_heads={self.num_heads} is a head size of {head}: "
                             "the built-in model's rotary position embeddings need an even head size")
        return self


class TaskSection(_Section):
    kind: Literal["reverse", "long_tail", "file", "sim"] = "reverse"
    """`reverse`: the built-in digit-reversal task. `long_tail`: reversal of strings of very different
    lengths (response lengths with a 99th percentile `tail` × their median). `file`: prompts from
    Parquet/JSONL, your reward. `sim`: the simulated workload's prompts and rewards (with the sim engine
    and trainer: nothing is learned)."""
    digits: int = Field(3, ge=1, le=12)
    """reverse: length of the digit string; long_tail: the median length."""
    max_digits: int = Field(28, ge=1, le=60)
    """long_tail: the longest string (responses are at most max_digits + 1 tokens)."""
    tail: float = Field(8.0, ge=1, allow_inf_nan=False)
    """long_tail: 99th percentile of the response length over its median."""
    prompts: str | None = None
    """file: Parquet (`.parquet`) or JSON-lines (`.jsonl`) file with one prompt per row."""
    eval_prompts: str | None = None
    """file: held-out prompts in the same format (optional)."""
    prompt_field: str = "prompt"
    """file: the column holding the prompt: text, or chat messages `[{role, content}, ...]`."""
    chat_template: bool = False
    """file: build each prompt with the tokenizer's chat template (text becomes one user message), ending
    where the assistant answers: how an instruction-tuned model expects its input. Needed for messages."""
    system_prompt: str | None = None
    """file, with chat_template: a system message put before each prompt that does not start with one."""
    reward: str | None = None
    """file: `module:function` called as `function(completion: str, row: dict) -> float`; a function with
    `batched = True` is called once per group as `function(completions: list[str], row) -> list[float]`."""
    reward_dir: str | None = None
    """file: the directory `reward`'s module is imported from first (None: the launch directory). A run
    records the absolute directory when it starts, so a resume imports the same module from anywhere."""
    reward_isolation: Literal["process", "inline"] = "process"
    """file: `process`: call the reward function in a worker process (one per producer), so a hang is
    cut at `reward_timeout_s` and a crash costs one sample, not the producer; `inline`: call it in the
    producer's thread (a little faster per call, but a hang is never cut: the timeout is not enforced)."""
    reward_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """file: a reward call still running after this long is a failed reward (`timeout`) and its worker
    is killed. Generous for string checks; raise it for rewards that run code or tests."""
    reward_min: float = Field(-1e6, allow_inf_nan=False)
    """file: a reward below this is a failed reward (`out_of_range`). The default bounds reject only
    values no reward scale means (overflow, sentinels like 1e30) and keep float32 rewards exact to
    ~0.06; set your function's real range (e.g. 0 and 1) to catch bugs that return plausible numbers."""
    reward_max: float = Field(1e6, allow_inf_nan=False)
    """file: a reward above this is a failed reward (`out_of_range`)."""
    reward_on_failure: float = Field(0.0, allow_inf_nan=False)
    """file: the reward a sample gets when its reward call fails: it raised, timed out, or returned
    NaN/inf, None, a non-number or a value outside [reward_min, reward_max]. Failures are counted by
    kind per producer in `summary.json` (`reward_failures`), and the run goes on."""
    eval_size: int = Field(256, ge=1)
    """At most this many held-out prompts are evaluated."""

    @model_validator(mode="after")
    def _reward_range(self) -> TaskSection:
        if self.reward_min > self.reward_max:
            raise ValueError(f"reward_min={self.reward_min} is above reward_max={self.reward_max}")
        return self

    @model_validator(mode="after")
    def _long_tail_lengths(self) -> TaskSection:
        if self.kind == "long_tail" and self.digits > self.max_digits:
            raise ValueError(f"kind = 'long_tail' with digits={self.digits} above max_digits={self.max_digits}: "
                             "the median string length (digits) must be at most the longest (max_digits)")
        return self


class SamplingSection(_Section):
    temperature: float = Field(1.0, ge=1e-3)
    """The trainer divides its logits by the same temperature, so behaviour and trainer log-probs agree. At
    least 0.001: far below it the scaled logits overflow (1e-40 gave NaN log-probs) and sampling is greedy anyway."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; must stay 1 for now. The trainer's log-probs are the full softmax's, so below 1 an
    on-policy token's ratio is the nucleus's kept mass (0.74 on average at 0.7), not 1: the masked and
    clipped losses would reject on-policy data. sglang's log-probs are of the untruncated distribution."""
    max_new_tokens: int | None = Field(None, ge=1)
    """None: the task's own limit (reverse: digits + 2)."""


class SglangSection(_Section):
    """sglang servers, started by each producer (`producers.engine = "sglang"`)."""

    servers: int = Field(1, ge=1)
    """Servers per producer (each gets `tensor_parallel` GPUs of the producer's)."""
    tensor_parallel: int = Field(1, ge=1)
    mem_fraction: float = Field(0.8, gt=0, le=1)
    """sglang's --mem-fraction-static: GPU memory for weights and KV cache."""
    host: str = "127.0.0.1"
    """Address the servers bind to: loopback, since each is driven by the producer on its own node."""
    base_port: int = Field(30000, ge=1024, le=65000)
    """Producer i's server j listens on base_port + i × servers + j."""
    memory_saver: bool = False
    """torch-memory-saver (--enable-memory-saver): release and resume memory when colocated with the trainer."""
    launcher: list[str] | None = Field(None, min_length=1)
    """The command before the server flags; None: `python -m sglang.launch_server`."""
    extra_args: list[str] = []
    startup_timeout_s: float = Field(600.0, gt=0, le=LONGEST_WAIT_S)
    weights: Literal["disk", "distributed", "tensor"] = "disk"
    """How a producer puts new weights into its servers: "disk" writes safetensors and calls
    /update_weights_from_disk; "distributed" broadcasts them over one process group
    per server (/init_weights_update_group, /update_weights_from_distributed) from the trainer's first
    rank, from its GPU (NCCL; gloo on CPU);
    "tensor" copies them bucket by bucket onto the server's GPU and passes CUDA IPC handles
    (/update_weights_from_tensor; one bucket of GPU memory in the producer, no disk, no group)."""
    bucket_mb: int = Field(512, ge=1)
    """"distributed" and "tensor": tensors per call, in MiB (a larger one alone)."""
    weights_timeout_s: float = Field(300.0, gt=0, le=LONGEST_WAIT_S)
    """"distributed": longest wait to form a group or move one bucket (a dead server cannot hang the producer)."""


class ProducerSection(_Section):
    count: int = Field(2, ge=1)
    """Rollout producer actors."""
    engine: Literal["torch", "sglang", "sim"] = "torch"
    """`torch`: the policy in the producer's process; `sglang`: the producer's sglang servers; `sim`: the
    calibrated timing model of `[sim]` (its slots are `sim.sequences_per_producer`)."""
    groups_per_batch: int = Field(16, ge=1)
    """Groups a producer runs at once (torch and sglang: groups_per_batch × G sequences); a finished
    sequence's slot is refilled at once (continuous batching), so a long response holds one slot."""
    threads: int = Field(1, ge=1)
    """torch threads per producer."""
    num_cpus: float = Field(0.5, ge=0)
    """Ray CPUs each producer reserves."""
    double_buffer: bool = True
    """Copy new weights into a second model in the background and swap at a decode step (no stall,
    twice the model memory); false: copy into the live model at the decode step."""
    weight_poll_s: float = Field(1.0, gt=0, le=60)
    """Longest wait of one long poll for newer weights (a new version is seen as soon as it is published;
    a stopping producer waits for its poll to end)."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs each producer reserves (its sglang servers run on them)."""
    max_restarts: int = Field(8, ge=0)
    """Producers that die (a crashed or preempted worker) are replaced, up to this many times in a run;
    one more death fails the run (a producer that keeps dying is a bug, not bad luck)."""
    sglang: SglangSection = SglangSection()


class TrainerSection(_Section):
    backend: Literal["torch", "megatron", "sim"] = "torch"
    """`sim`: the timing model of `[sim]` (sleeps `train_s_per_token` per response token, publishes real
    weights of `sim.weights_mb`), for benchmarking the pipeline without the model's arithmetic."""
    lr: float = Field(1e-3, gt=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.99)
    """Adam's β1, β2, each in [0, 1)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled decay, of weight matrices only (as Megatron: no bias or norm scale is decayed)."""
    grad_clip: float = Field(1.0, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """The learning rate per optimizer step after the warm-up (`streamrl/trainer/schedule.py`); the step
    count is saved with each checkpoint, so a resumed run continues the schedule exactly."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up from lr / warmup_steps to lr."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """The optimizer step at which a cosine or linear decay reaches lr × min_lr_ratio (counted from the
    start, warm-up included). None: the run's, run.steps × minibatches. A resume that would move that end
    (another run.steps or minibatches) must set it: to the old end to keep the schedule, or to a new one."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (Hugging Face models, torch backend): less memory,
    about a third more compute."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Padded tokens per forward/backward; bounds activation memory (gradients are accumulated)."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per consumed batch (PPO mini-batches, each a share of the batch's groups): more
    learning per generated sample; the policy version still advances once per batch."""
    tensor_parallel: int = Field(1, ge=1)
    """megatron backend: tensor-parallel ranks the model is split over, one Ray actor each, each
    reserving `num_cpus` and `num_gpus`."""
    data_parallel: int = Field(1, ge=1)
    """megatron backend: copies of the (tensor-parallel) model, each training on its share of every
    mini-batch's groups, gradients summed across them. Above 1, `queue.groups_per_step` must be
    divisible by data_parallel × minibatches."""
    pipeline_parallel: int = Field(1, ge=1)
    """megatron backend: stages the model's layers are split over in order (it must divide the layer
    count), micro-batches flowing through them one-forward-one-backward; the trainer runs
    tensor_parallel × data_parallel × pipeline_parallel rank actors."""
    collective_timeout_s: float = Field(600.0, gt=0, le=LONGEST_WAIT_S)
    """megatron backend: longest wait for the other ranks (joining, each collective); a dead rank
    fails the run after this instead of hanging it."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """grpo: (r − mean)/(std + eps) per group; drgrpo: r − mean; rloo: leave-one-out baseline."""
    threads: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs the trainer reserves; with one, the trainer (torch or megatron) runs on CUDA."""
    colocated: bool = False
    """The trainer shares its GPUs with the producers' sglang servers: at each step the servers pause
    and free their memory, the trainer loads itself, trains, publishes and offloads, the servers resume."""
    reference_offload: bool = False
    """With loss.kl_coef > 0: keep the reference policy (a frozen copy of the initial weights) in host
    memory between steps, moved to the trainer's GPU for its forward pass only."""
    get_timeout_s: float = Field(300.0, gt=0, le=LONGEST_WAIT_S)
    """The trainer gives up when no batch arrives for this long (not counted while the operator has paused
    admission): the run stops with a checkpoint and fails."""
    diagnose_every: int = Field(0, ge=0)
    """Every this many steps, measure whether the step's stale data points where fresh data would
    (`streamrl/trainer/diagnostics.py`): the step's prompts are sampled again by the current weights, and
    the policy gradients of two random halves of the groups, stale and fresh, give `grad_cos_*` and
    `grad_signal_alignment` (about 1 when they agree); `update_kl` is KL(before → after the step) on the
    fresh samples. Costs a generation and about two more forward-backward passes over the batch on those
    steps. 0: off. torch backend."""

    @property
    def ranks(self) -> int:
        """Trainer ranks (one Ray actor each): tensor × data × pipeline parallel."""
        return self.tensor_parallel * self.data_parallel * self.pipeline_parallel


class LoggingSection(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """What each process writes to `RUN_DIR/logs/<actor>.log` (`--log-level`): weight loads and their stall,
    admission holds, groups given back, reward failures, server restarts, replaced producers."""
    progress: Literal["auto", "bar", "line", "none"] = "auto"
    """auto: a live bar on a terminal, one line every `line_every` steps otherwise."""
    line_every: int = Field(10, ge=1)
    wandb: bool = False
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "streamrl"


class RaySection(_Section):
    address: str | None = None
    """None: start a local Ray instance for the run; `auto`, HOST:PORT or ray://HOST:PORT: join a cluster."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local instance (default: all)."""

    @field_validator("address")
    @classmethod
    def _a_cluster_address(cls, address: str | None) -> str | None:
        problem = None if address is None else cluster_address_problem(address)
        if problem is not None:
            raise ValueError(problem)
        return address

    @model_validator(mode="after")
    def _cpus_of_a_local_instance_only(self) -> RaySection:
        if self.address is not None and self.num_cpus is not None:  # a cluster has its own: it was ignored
            raise ValueError(f"ray.num_cpus = {self.num_cpus} sizes a local Ray instance; with ray.address = "
                             f"{self.address!r} the cluster's own CPUs count (set them with `ray start --num-cpus`)")
        return self


# A run's queue where its config says nothing; a `[queue]` table that sets some fields keeps these for the
# rest (it fell back to QueueConfig's own defaults, and setting any one field moved η from 2 to 1).
_RUN_QUEUE = {"group_size": 8, "groups_per_step": 32, "max_staleness": 2, "max_in_flight": 64}


def _default_queue() -> QueueConfig:
    return QueueConfig(**_RUN_QUEUE)


class RunConfig(_Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    sampling: SamplingSection = SamplingSection()
    producers: ProducerSection = ProducerSection()
    queue: QueueConfig = Field(default_factory=_default_queue)
    trainer: TrainerSection = TrainerSection()
    loss: LossConfig = LossConfig()
    logging: LoggingSection = LoggingSection()
    ray: RaySection = RaySection()
    sim: SimSection = SimSection()

    @field_validator("queue", mode="before")
    @classmethod
    def _queue_over_run_defaults(cls, value: object) -> object:
        return {**_RUN_QUEUE, **value} if isinstance(value, dict) else value

    @property
    def optimizer_steps(self) -> int:
        """The run's optimizer steps (run.steps × trainer.minibatches): where a decaying learning-rate
        schedule ends unless trainer.lr_decay_steps says otherwise."""
        return self.run.steps * self.trainer.minibatches

    def sim_workload(self) -> SimWorkload:
        """`[sim]` with the layout the rest of the config gives (producers, G, B)."""
        return SimWorkload(**self.sim.model_dump(), producers=self.producers.count,
                           group_size=self.queue.group_size, groups_per_step=self.queue.groups_per_step)

    def _backends_fit(self) -> None:
        """What the chosen backends need of the model settings and of the installed packages."""
        model = self.model
        if model.dtype != "float32" and self.trainer.backend == "megatron":
            # megatron's tensor-parallel layers run their own backward, which autocast does not reach:
            # bf16 there needs megatron's mixed-precision optimizer, which streamrl does not build yet
            raise ValueError(f"model.dtype = {model.dtype!r} with trainer.backend = 'megatron': the megatron "
                             "trainer trains in float32 only; use the torch trainer, or model.dtype = 'float32'")
        if self.trainer.backend == "megatron":
            from streamrl.megatron.versions import check_megatron_core

            try:
                check_megatron_core()
            except RuntimeError as exc:
                raise ValueError(str(exc)) from None
        if model.attention == "flash_attention_2":
            if importlib.util.find_spec("flash_attn") is None:
                raise ValueError("model.attention = 'flash_attention_2' needs the flash-attn package, which is "
                                 "not installed; use 'sdpa'")
            if model.dtype == "float32":
                raise ValueError("model.attention = 'flash_attention_2' runs in bfloat16 only: set "
                                 "model.dtype = 'bfloat16', or use 'sdpa'")

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        task, queue = self.task, self.queue
        sim = {"producers.engine": self.producers.engine, "trainer.backend": self.trainer.backend,
               "task.kind": task.kind}
        if "sim" in sim.values() and set(sim.values()) != {"sim"}:
            raise ValueError("the simulator runs whole: producers.engine, trainer.backend and task.kind must all be "
                             f"'sim' (got {', '.join(f'{k} = {v!r}' for k, v in sim.items())})")
        if self.producers.engine == "sim" and self.sim.sequences_per_producer < queue.group_size:
            raise ValueError(f"sim.sequences_per_producer={self.sim.sequences_per_producer} cannot hold one group of "
                             f"queue.group_size={queue.group_size}: a producer decodes a group's samples together")
        if task.kind == "file":
            missing = [name for name in ("prompts", "reward") if getattr(task, name) is None]
            if missing:
                raise ValueError(f"task.kind = 'file' needs task.{' and task.'.join(missing)}")
            if self.model.path is None:
                raise ValueError("task.kind = 'file' needs model.path: the built-in model only knows the "
                                 "reverse task's characters")
        if task.system_prompt is not None and not task.chat_template:
            raise ValueError("task.system_prompt is put in by the chat template: set task.chat_template = true")
        if queue.group_size < 2:  # every advantage is relative to the group's others: alone, it is 0
            raise ValueError(f"queue.group_size={queue.group_size}: group advantages need at least 2 samples "
                             "per prompt")
        if self.trainer.minibatches > queue.groups_per_step:
            raise ValueError(f"trainer.minibatches={self.trainer.minibatches} is more than queue.groups_per_step="
                             f"{queue.groups_per_step}: a mini-batch holds at least one whole group")
        shares = self.trainer.data_parallel * self.trainer.minibatches  # one rank alone splits unevenly
        if self.trainer.data_parallel > 1 and queue.groups_per_step % shares:
            raise ValueError(f"queue.groups_per_step={queue.groups_per_step} is not divisible by trainer.data_parallel="
                             f"{self.trainer.data_parallel} × trainer.minibatches={self.trainer.minibatches}: every "
                             "data-parallel rank trains on the same number of whole groups in each mini-batch")
        if self.trainer.colocated and not (self.producers.engine == "sglang" and self.producers.sglang.memory_saver):
            raise ValueError("trainer.colocated = true needs producers.engine = 'sglang' with "
                             "producers.sglang.memory_saver = true (the servers free their GPU memory in turn)")
        sg = self.producers.sglang
        gpus = math.ceil(self.producers.num_gpus)  # a fraction of a GPU is a share of one (colocated)
        if self.producers.engine == "sglang" and 0 < gpus < sg.servers * sg.tensor_parallel:
            raise ValueError(f"producers.num_gpus={self.producers.num_gpus:g} is fewer than the "
                             f"{sg.servers * sg.tensor_parallel} GPUs its sglang servers use "
                             "(producers.sglang.servers × producers.sglang.tensor_parallel)")
        decay = self.trainer.lr_decay_steps or self.optimizer_steps
        if self.trainer.lr_schedule != "constant" and decay <= self.trainer.warmup_steps:
            raise ValueError(f"trainer.lr_schedule = {self.trainer.lr_schedule!r} decays after the warm-up, but "
                             f"trainer.warmup_steps={self.trainer.warmup_steps} reaches the decay's end ({decay} "
                             "optimizer steps: trainer.lr_decay_steps, else run.steps × trainer.minibatches)")
        self._backends_fit()
        if self.loss.kl_coef > 0 and self.trainer.backend == "sim":
            raise ValueError("loss.kl_coef > 0 with trainer.backend = 'sim': the simulator has no policy to keep a "
                             "reference copy of")
        if self.trainer.gradient_checkpointing and self.trainer.backend != "torch":
            raise ValueError("trainer.gradient_checkpointing needs trainer.backend = 'torch' (Hugging Face models)")
        if self.sampling.top_p != 1.0:
            # The torch engine stamps the nucleus's renormalised log-prob, which the trainer's full softmax is
            # not (on-policy ratios = the kept mass; masked_is rejected every token at 0.9, outside review);
            # sglang returns log_softmax(logits / temperature) before top-p, not the behaviour policy's.
            raise ValueError(f"sampling.top_p={self.sampling.top_p:g}: the trainer's log-probs are of the whole "
                             "distribution, not the top-p nucleus the engines sample from (sglang's log-probs "
                             "are of the whole distribution too), so on-policy ratios would not be 1; use top_p = 1")
        if self.producers.engine == "sglang" and sg.weights == "distributed":
            if self.trainer.colocated:  # NCCL refuses a group with two ranks on one device
                raise ValueError("producers.sglang.weights = 'distributed' sends from the trainer's GPU, which "
                                 "trainer.colocated = true shares with the servers: use 'tensor' (CUDA IPC)")
            if gpus and not self.trainer.num_gpus:
                raise ValueError("producers.sglang.weights = 'distributed' with servers on GPUs needs "
                                 "trainer.num_gpus >= 1: the trainer sends over NCCL from its GPU")
        for kind in ("tensor_parallel", "data_parallel", "pipeline_parallel"):
            size = getattr(self.trainer, kind)
            if size > 1 and self.trainer.backend != "megatron":
                raise ValueError(f"trainer.{kind}={size} needs trainer.backend = 'megatron'")
            if size > 1 and self.trainer.colocated:
                raise ValueError(f"trainer.colocated = true with trainer.{kind} > 1 is not supported: one trainer "
                                 "rank takes turns with the servers (offloaded ranks cannot run collectives)")
        if self.trainer.diagnose_every and self.trainer.backend != "torch":
            raise ValueError(f"trainer.diagnose_every={self.trainer.diagnose_every} needs trainer.backend = 'torch' "
                             "(its gradient comparison reads the whole model's gradient in one process)")
        return self


# ---- loading ---------------------------------------------------------------------------------------

def _parse_value(text: str) -> Any:
    """A `--set` value: TOML syntax when it parses (numbers, booleans, arrays, quoted strings), `null` for
    an unset optional field (TOML has no null), else a bare string. A date or time is kept as the text
    (no field holds one: `run.name=2024-06-01` means the string)."""
    if text == "null":
        return None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return text if isinstance(value, datetime.date | datetime.time) else value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` pairs applied to a nested dict (a new one is returned)."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        *path, leaf = parts = [part.strip() for part in key.split(".")]
        if not all(parts):
            raise ConfigError(f"--set {item!r}: {key.strip()!r} has an empty name between its dots")
        node = tree
        for part in path:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[leaf] = _parse_value(value.strip())
    return tree


_INT64 = 2**63


def _optional_of(annotation: Any) -> Any:
    """`X` for `X | None`; any other annotation as it is."""
    if get_origin(annotation) in (Union, UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        return options[0] if len(options) == 1 else annotation
    return annotation


def _holds_text(where: str) -> bool:
    """Whether the config field at a dotted path (a list's items by their index) holds a string."""
    annotation: Any = RunConfig
    for part in where.split("."):
        annotation = _optional_of(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and part in annotation.model_fields:
            annotation = annotation.model_fields[part].annotation
        elif get_origin(annotation) is list and part.isdigit():
            annotation = get_args(annotation)[0]
        else:
            return False
    return _optional_of(annotation) is str


def _check_values(value: Any, where: str = "") -> None:
    """What the schema cannot say: numbers are finite and fit in 64 bits, and only TOML's plain types
    (tables, arrays, strings, numbers, booleans) occur, never a date."""
    if isinstance(value, dict):
        for key, child in value.items():
            _check_values(child, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            _check_values(child, f"{where}.{index}")
    elif isinstance(value, float) and not math.isfinite(value):
        if _holds_text(where):  # `--set run.name=nan` reads as TOML's nan, not as the name "nan"
            quoted = f'"{value}"' if where.rpartition(".")[2].isdigit() else f"""--set '{where}="{value}"'"""
            raise ConfigError(f"invalid config: {where}: {value} reads as a number (not a finite one), and "
                              f"{where} holds text: quote it to make it a string ({quoted})")
        raise ConfigError(f"invalid config: {where}: {value} is not a finite number")
    elif isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
        raise ConfigError(f"invalid config: {where}: {value} does not fit in a 64-bit integer")
    elif value is not None and not isinstance(value, str | int | float):
        raise ConfigError(f"invalid config: {where}: a TOML {type(value).__name__} is not a valid value "
                          "(quote it to make it a string)")


def _describe(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(str(p) for p in problem["loc"]) or "config"
        value = problem.get("input")
        shown = "" if isinstance(value, dict) or problem["type"] == "missing" else f" (got {value!r})"
        lines.append(f"{where}: {problem['msg']}{shown}")
    return "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Validate a config tree as it comes from TOML. Types are strict (pydantic's JSON mode: a string is
    not a number, `true` is not 1, 2.0 is not an int), so a typo never turns into a silent conversion."""
    _check_values(tree)
    try:
        return RunConfig.model_validate_json(json.dumps(tree), strict=True)
    except ValidationError as exc:
        raise ConfigError(f"invalid config: {_describe(exc)}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The validated config from a TOML file (None: the built-in default) plus `--set` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {problem}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {exc}") from None
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    return config_from_dict(apply_overrides(tree, overrides or []))


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, tuple | list):
        return [_without_none(v) for v in value]
    return value


def dump_config(config: RunConfig) -> str:
    """TOML that `load_config` reads back to an equal config (TOML has no null: unset fields are left out)."""
    return tomli_w.dumps(_without_none(config.model_dump(mode="json")))
