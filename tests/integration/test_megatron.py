"""The megatron-core backend on CPU (gloo): HF ⇄ Megatron conversion, logits and gradients against the
Hugging Face model at TP = 1 and 2, and one trainer step against the torch trainer."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from checkout import ROOT
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from harness.synthetic import synthetic_batch
from streamrl.buffer import QueueConfig, ReplayQueue
from streamrl.config import TrainerSection
from streamrl.correction import LossConfig, token_logprobs
from streamrl.megatron.convert import Layout, Stage, hf_names, hf_to_megatron, megatron_to_hf
from streamrl.models.hf import load_policy
from streamrl.models.tiny import build_tokenizer
from streamrl.net import free_port
from streamrl.tasks.reverse import CharVocab
from streamrl.trainer.torch_trainer import TorchTrainer
from streamrl.weights.arrays import state_arrays

VOCAB = len(CharVocab())  # 17: odd, so TP = 2 pads the vocabulary


def hf_model(kind: str) -> torch.nn.Module:
    """Grouped-query attention (4 heads, 2 key/value heads); norms and biases randomised so that a
    misplaced one shows."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", ".bias")):
                tensor.copy_(1 + 0.3 * torch.randn_like(tensor))
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf_model(request.param).save_pretrained(directory)
    build_tokenizer(CharVocab()).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_to_hf_is_an_exact_round_trip(kind, tp):
    model = hf_model(kind)
    layout = Layout.from_hf(model.config)
    hf = model.state_dict()
    shards = [hf_to_megatron(hf, layout, rank=r, tp=tp) for r in range(tp)]
    back = megatron_to_hf(shards, layout)
    assert set(back) == set(state_arrays(model))  # HF names, tied embeddings once
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 8 // tp, 32)  # whole query groups per rank: q heads, k, v
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == layout.padded_vocab(tp) // tp


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_pipeline_stages_convert_their_own_layers_and_round_trip_exactly(kind):
    """Two stages × TP 2: layer 1 is the second stage's layer 0; the embedding is on the first stage,
    the norm and output layer on the last (a tied embedding as a copy there, exported once)."""
    model = hf_model(kind)
    layout = Layout.from_hf(model.config)
    hf = model.state_dict()
    back = {}
    for rank in range(2):
        stage = Stage.of(layout, rank, 2)
        shards = [hf_to_megatron(hf, layout, rank=r, tp=2, stage=stage) for r in range(2)]
        part = megatron_to_hf(shards, layout, stage)
        assert sorted(part) == sorted(hf_names(layout, stage)) and not set(part) & set(back)
        back.update(part)
        assert ("embedding.word_embeddings.weight" in shards[0]) == (rank == 0)
        assert ("decoder.final_layernorm.weight" in shards[0]) == (rank == 1)
        assert not any(name.startswith("decoder.layers.1.") for name in shards[0])
    assert shards[0]["decoder.layers.0.mlp.linear_fc2.weight"].equal(hf["model.layers.1.mlp.down_proj.weight"][:, :32])
    source = "model.embed_tokens.weight" if layout.tied else "lm_head.weight"
    assert shards[1]["output_layer.weight"].equal(_pad(hf[source], layout.padded_vocab(2))[layout.padded_vocab(2) // 2:])
    assert set(back) == set(state_arrays(model))
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name
    with pytest.raises(ValueError, match="pipeline parallel size 3 does not divide the model's 2 layers"):
        Stage.of(layout, 0, 3)


def _pad(table: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([table, table.new_zeros(rows - len(table), *table.shape[1:])])


def test_conversion_refuses_what_it_cannot_split_or_does_not_know():
    layout = Layout.from_hf(hf_model("qwen2").config)
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide key/value heads = 2"):
        hf_to_megatron(hf_model("qwen2").state_dict(), layout, tp=4)
    with pytest.raises(KeyError, match="lack"):
        hf_to_megatron({}, layout)
    gpt2 = type("Config", (), {"model_type": "gpt2"})()
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        Layout.from_hf(gpt2)
    config = hf_model("qwen2").config
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        Layout.from_hf(config)
    config = hf_model("qwen2").config
    config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="sliding-window"):
        Layout.from_hf(config)


# ---- megatron-core in worker processes (gloo), one per tensor-parallel rank ------------------------------

def run_ranks(worker, world: int, *args) -> None:
    mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)


def token_batch(n: int = 3, width: int = 9) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(7).integers(0, VOCAB, (n, width)))


def forward_worker(rank, world, port, model_dir, out):
    torch.set_num_threads(1)
    from streamrl.megatron import parallel
    from streamrl.megatron.model import build_model, token_logprobs

    parallel.initialize(rank=rank, world_size=world, tensor_parallel=world, master_port=port)
    hf, _ = load_policy(model_dir)
    model, layout, _ = build_model(hf.config)
    model.load_state_dict(hf_to_megatron(hf.state_dict(), layout, rank=rank, tp=world), strict=False)
    ids = token_batch()
    width = ids.shape[1]
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)[None, None]
    logits = model(ids, torch.arange(width).expand_as(ids), causal).detach()
    logprobs = token_logprobs(model, layout, ids, temperature=0.7)
    logprobs.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    torch.save({"logits": logits, "logprobs": logprobs.detach(), "grads": grads}, f"{out}/rank{rank}.pt")
    parallel.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_logits_logprobs_and_gradients_match_the_hf_model(model_dir, tmp_path, tp):
    run_ranks(forward_worker, tp, str(model_dir), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(tp)]
    hf, _ = load_policy(model_dir, train=True)
    layout = Layout.from_hf(hf.config)
    ids = token_batch()
    logits = hf(input_ids=ids).logits
    megatron_logits = torch.cat([r["logits"] for r in ranks], dim=-1)[..., :VOCAB]
    torch.testing.assert_close(megatron_logits, logits.detach(), atol=1e-4, rtol=0)
    logprobs = token_logprobs(logits[:, :-1] / 0.7, ids[:, 1:])
    for r in ranks:  # every rank holds the whole log-probs: only the logits were split
        torch.testing.assert_close(r["logprobs"], logprobs.detach(), atol=1e-4, rtol=0)
    logprobs.sum().backward()
    grads = megatron_to_hf([r["grads"] for r in ranks], layout)
    for name, param in hf.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, atol=1e-4, rtol=1e-4, msg=name)


def step_batch():
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=4, max_in_flight=64))
    return synthetic_batch(queue.admit(0, 4).tickets, 4, prompt_len=(2, 5), response_len=(2, 7), vocab_size=VOCAB,
                           rng=np.random.default_rng(5))


STEP = dict(lr=1e-2, minibatches=2, micro_batch_tokens=24)


def trainer_worker(rank, world, port, model_dir, out, pp=1, kl_coef=0.0):
    torch.set_num_threads(1)
    from streamrl.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(model_dir, trainer=TrainerSection(tensor_parallel=world // pp, pipeline_parallel=pp,
                                                                **STEP),
                              loss=LossConfig(name="decoupled_ppo", kl_coef=kl_coef), group_size=4, rank=rank,
                              world_size=world, master_port=port)
    metrics = trainer.train(step_batch())
    state = trainer.backend.hf_state()
    if rank == 0:
        torch.save({"metrics": metrics, "state": state, "version": trainer.version}, f"{out}/step.pt")
    trainer.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_one_megatron_trainer_step_matches_the_torch_trainer(model_dir, tmp_path, tp):
    if torch.cuda.is_available():
        pytest.skip("the CPU (gloo) variant; see the gpu test below")
    run_ranks(trainer_worker, tp, str(model_dir), str(tmp_path))
    check_step_against_torch(model_dir, tmp_path, atol=1e-4)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_a_kl_penalty_step_matches_the_torch_trainer(qwen2_dir, tmp_path, tp, pp):
    """The reference policy as megatron stages: its own tensor-parallel shards, its own pipeline pass."""
    if torch.cuda.is_available():
        pytest.skip("the CPU (gloo) variant")
    run_ranks(trainer_worker, tp * pp, str(qwen2_dir), str(tmp_path), pp, 0.5)
    check_step_against_torch(qwen2_dir, tmp_path, atol=1e-4, kl_coef=0.5)


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_a_pipeline_parallel_step_matches_the_torch_trainer(model_dir, tmp_path, tp, pp):
    """Two stages of one layer each, micro-batches in 1F1B order (STEP cuts each mini-batch into
    several), the proximal pass forward only; Qwen2's tied embedding lives on both ends of the
    pipeline, Llama's output layer on the last stage alone. TP = 2 as well: world 4."""
    if torch.cuda.is_available():
        pytest.skip("the CPU (gloo) variant")
    run_ranks(trainer_worker, tp * pp, str(model_dir), str(tmp_path), pp)
    check_step_against_torch(model_dir, tmp_path, atol=1e-4)


@pytest.mark.gpu
def test_on_cuda_one_megatron_trainer_step_matches_the_torch_trainer(model_dir, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_ranks(trainer_worker, 1, str(model_dir), str(tmp_path))  # the worker sees the GPU: NCCL, CUDA model
    check_step_against_torch(model_dir, tmp_path, atol=1e-3)


def check_step_against_torch(model_dir, tmp_path, atol, kl_coef=0.0):
    result = torch.load(tmp_path / "step.pt", weights_only=True, map_location="cpu")
    reference = TorchTrainer(model_dir, trainer=TrainerSection(**STEP),
                             loss=LossConfig(name="decoupled_ppo", kl_coef=kl_coef), group_size=4)
    metrics = reference.train(step_batch())
    if kl_coef:  # the second mini-batch sees θ moved by the first: a penalty that is not zero
        assert result["metrics"]["kl_ref"] == pytest.approx(metrics["kl_ref"], abs=atol) and metrics["kl_ref"] > 0
    assert result["version"] == 1
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=atol / 10)
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=atol)
    assert set(result["state"]) == set(state_arrays(reference.backend.model))  # every tensor came back (all stages)
    worst = 0.0
    for name, tensor in result["state"].items():
        # A key bias adds q·b to every key of a query alike, which the softmax cancels: its true gradient
        # is 0, AdamW turns the rounding noise left in it into a step of up to lr, so it is not compared.
        if not name.endswith("k_proj.bias"):
            expected = reference.backend.model.state_dict()[name].cpu()
            torch.testing.assert_close(tensor, expected, atol=atol, rtol=0, msg=name)
            worst = max(worst, float((tensor - expected).abs().max()))
    print(f"largest parameter difference against the torch trainer after the step: {worst:.2e}")


def final_norm_worker(rank, world, port, model_dir, out, installed):
    """Builds the model as if Transformer Engine or apex were importable: megatron-core's choice of the
    final norm is the module-level `LayerNormImpl`, made at import from what is installed."""
    import json

    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer import transformer_block

    from streamrl.megatron import parallel
    from streamrl.megatron.model import build_model

    class TransformerEngineNorm(torch.nn.Module):  # stands for TENorm, chosen when transformer_engine imports
        def __init__(self, *args, **kwargs):
            super().__init__()

    transformer_block.LayerNormImpl = {"transformer_engine": TransformerEngineNorm, "apex": FusedLayerNorm}[installed]
    parallel.initialize(rank=rank, world_size=world, master_port=port)
    hf, _ = load_policy(model_dir)
    try:
        model, _, _ = build_model(hf.config)
        norms = {name: type(module).__name__ for name, module in model.named_modules() if name.endswith("norm")}
    except Exception as exc:  # noqa: BLE001 — the test reports what building did
        norms = {"error": f"{type(exc).__name__}: {exc}"}
    (Path(out) / "norms.json").write_text(json.dumps(norms))
    parallel.shutdown()


@pytest.mark.parametrize("installed", ["transformer_engine", "apex"])
def test_the_final_norm_is_the_local_rmsnorm_whatever_is_installed(qwen2_dir, tmp_path, installed):
    import json

    run_ranks(final_norm_worker, 1, str(qwen2_dir), str(tmp_path), installed)
    norms = json.loads((tmp_path / "norms.json").read_text())
    assert norms.get("decoder.final_layernorm") == "RMSNorm", norms  # torch's, as WrappedTorchNorm builds it
    assert set(norms.values()) <= {"RMSNorm", "IdentityOp"}, norms  # IdentityOp: the norms Qwen2 does not have


def offload_worker(rank, world, port, model_dir, out):
    import json

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from streamrl.megatron.model import held_tensors
    from streamrl.trainer.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    trainer = MegatronTrainer(model_dir, trainer=TrainerSection(**STEP), loss=LossConfig(name="decoupled_ppo",
                              kl_coef=0.1), group_size=4, rank=rank, world_size=world, master_port=port)
    trainer.train(step_batch())

    def facts():
        models = (trainer.backend.model, trainer.backend.reference)
        held = held_tensors(*models)
        plain = [where for where, _ in held if where.endswith("inv_freq")]
        return {"off_cpu": [where for where, t in held if t.device.type != "cpu"],
                "scratch_bytes": sum(t.nbytes for where, t in held if where.startswith("global memory buffer")),
                "rotary_cached": RotaryEmbedding.forward.cache_info().currsize, "plain_attributes": plain}

    before = facts()
    allocated = [torch.cuda.memory_allocated() if torch.cuda.is_available() else 0]
    trainer.offload()
    after = facts()
    allocated.append(torch.cuda.memory_allocated() if torch.cuda.is_available() else 0)
    trainer.onload()
    metrics = trainer.train(step_batch())  # everything released comes back by itself
    (Path(out) / "offload.json").write_text(json.dumps({"before": before, "after": after, "cuda_allocated": allocated,
                                                        "loss_after_onload": metrics["loss"]}))
    trainer.close()


def offloaded(model_dir, tmp_path) -> dict:
    import json

    run_ranks(offload_worker, 1, str(model_dir), str(tmp_path))
    return json.loads((tmp_path / "offload.json").read_text())


def test_offload_leaves_no_scratch_or_cached_tensor_behind_and_the_next_step_runs(qwen2_dir, tmp_path):
    """`Module.to` moves parameters and buffers only: megatron-core's scratch buffer, its rotary cache
    and tensors kept as plain attributes stay where they are (on a GPU: memory the servers need)."""
    result = offloaded(qwen2_dir, tmp_path)
    before, after = result["before"], result["after"]
    assert before["scratch_bytes"] > 0 and before["rotary_cached"] > 0  # the step filled them
    assert before["plain_attributes"]  # the rotary inverse frequencies of the policy and the reference
    assert after["scratch_bytes"] == 0 and after["rotary_cached"] == 0
    assert after["off_cpu"] == [] and after["plain_attributes"] == before["plain_attributes"]
    assert np.isfinite(result["loss_after_onload"])


@pytest.mark.gpu
def test_on_cuda_offload_gives_the_device_memory_back(qwen2_dir, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    result = offloaded(qwen2_dir, tmp_path)
    assert result["after"]["off_cpu"] == [], result
    before, after = result["cuda_allocated"]
    print(f"CUDA memory allocated by the trainer: {before / 2**20:.2f} MiB before offload, "
          f"{after / 2**20:.2f} MiB after")
    assert after <= 0.05 * before, result


@pytest.mark.gpu
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_on_two_gpus_a_model_parallel_step_matches_the_torch_trainer(model_dir, tmp_path, tp, pp):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    run_ranks(trainer_worker, tp * pp, str(model_dir), str(tmp_path), pp)  # NCCL, one GPU per rank
    check_step_against_torch(model_dir, tmp_path, atol=1e-3)


# ---- data parallel: each DP rank trains on its share of the groups, gradients summed -----------------------

# lr 1e-3, not STEP's 1e-2: AdamW's first update is ≈ lr · g/|g|, which turns float rounding in a small
# gradient into a visible step. At 1e-2 the same DP = 1 step with its micro-batches cut at 12 instead of
# 24 tokens already moves parameters by up to 2.8e-5 (DP = 2: 6e-5); at 1e-3, 2.7e-6 (DP = 2: 5.6e-6).
DP_STEP = dict(STEP, lr=1e-3)


def dp_worker(rank, world, port, model_dir, out, dp, poison, pp=1):
    """One step at TP = world / (DP × PP); every rank saves its own weights (DP ranks must agree) and metrics.
    `poison`: DP rank 1's loss is NaN in the second mini-batch (after the first one was applied)."""
    torch.set_num_threads(1)
    from streamrl.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(model_dir, trainer=TrainerSection(tensor_parallel=world // (dp * pp), data_parallel=dp,
                                                                pipeline_parallel=pp, **DP_STEP),
                              loss=LossConfig(name="decoupled_ppo"), group_size=4, rank=rank, world_size=world,
                              master_port=port)
    before = {name: t.clone() for name, t in trainer.backend.model.state_dict().items() if isinstance(t, torch.Tensor)}
    if poison and trainer.backend.dp_rank == 1:
        inner, calls = trainer.plan.loss_fn, []

        def poisoned(policy_batch, **kwargs):
            calls.append(1)
            value, metrics = inner(policy_batch, **kwargs)
            return (value * float("nan") if len(calls) > 1 else value), metrics

        trainer.plan = dataclasses.replace(trainer.plan, loss_fn=poisoned)
    try:
        metrics, error = trainer.train(step_batch()), None
    except FloatingPointError as exc:
        metrics, error = {}, str(exc)
    after = {name: t for name, t in trainer.backend.model.state_dict().items() if isinstance(t, torch.Tensor)}
    state = trainer.backend.hf_state()
    torch.save({"metrics": metrics, "error": error, "version": trainer.version, "before": before, "after": after,
                "hf": state, "optimizer": bool(trainer.backend.optimizer.state)}, f"{out}/rank{rank}.pt")
    trainer.close()


def run_dp(model_dir, tmp_path, name, tp, dp, poison=False, pp=1):
    out = tmp_path / name
    out.mkdir()
    run_ranks(dp_worker, tp * dp * pp, str(model_dir), str(out), dp, poison, pp)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(tp * dp * pp)]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Qwen2 only (tied embeddings, QKV bias): data parallelism does not depend on the architecture."""
    directory = tmp_path_factory.mktemp("hf-qwen2-dp")
    hf_model("qwen2").save_pretrained(directory)
    build_tokenizer(CharVocab()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def one_rank_step(qwen2_dir, tmp_path_factory):
    """The reference: the same step on one rank (TP = 1, DP = 1)."""
    return run_dp(qwen2_dir, tmp_path_factory.mktemp("dp1"), "dp1", 1, 1)[0]


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_a_data_parallel_step_equals_the_one_rank_step(qwen2_dir, one_rank_step, tmp_path, tp, pp):
    """DP = 2 on the same batch: each rank trains on 1 of each mini-batch's 2 groups, the loss is
    normalised by both ranks' tokens and the gradients are summed, so the step is the one-rank step
    (TP = 2 or PP = 2 as well: world 4; ranks 0 and 1 are then DP peers of the first stage)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU (gloo) variant")
    one = one_rank_step
    ranks = run_dp(qwen2_dir, tmp_path, "dp2", tp, 2, pp=pp)
    two = ranks[0]
    assert two["version"] == one["version"] == 1 and two["error"] is None
    print("metrics DP=1", one["metrics"], "\nmetrics DP=2", two["metrics"])
    assert set(two["metrics"]) == set(one["metrics"])
    assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    for name, value in one["metrics"].items():  # loss, clipped fractions, tokens, ess ... reduced over the DP ranks
        if name != "train_s":
            assert two["metrics"][name] == pytest.approx(value, abs=1e-6), name
    worst = 0.0
    for name, tensor in one["hf"].items():
        # k_proj.bias: its true gradient is 0 (see check_step_against_torch), AdamW scales rounding noise
        if not name.endswith("k_proj.bias"):
            worst = max(worst, float((two["hf"][name] - tensor).abs().max()))
    print(f"TP={tp} PP={pp}: largest parameter difference DP=2 vs one rank after the step: {worst:.2e}")
    assert worst < 1e-5, worst
    for rank in ranks[tp:]:  # DP rank 1 holds the same weights as DP rank 0 (its TP peer), and exports nothing
        assert rank["hf"] == {}
    for r in range(tp):
        for name, tensor in ranks[r]["after"].items():
            assert torch.equal(ranks[r + tp]["after"][name], tensor), name


def test_a_non_finite_gradient_on_one_data_parallel_rank_rolls_back_every_rank(qwen2_dir, tmp_path):
    ranks = run_dp(qwen2_dir, tmp_path, "poison", 1, 2, poison=True)
    for rank in ranks:  # the NaN was on DP rank 1 only, in the second mini-batch: both ranks undo both
        assert rank["error"] and "non-finite gradient norm at version 0" in rank["error"]
        assert rank["version"] == 0 and not rank["optimizer"]
        for name, tensor in rank["before"].items():
            assert torch.equal(rank["after"][name], tensor), name


def test_the_config_refuses_data_parallel_shares_that_are_not_whole_groups():
    from streamrl.config import ConfigError, load_config

    megatron = ["trainer.backend=\"megatron\"", "queue.groups_per_step=12", "trainer.minibatches=2"]
    assert load_config(None, [*megatron, "trainer.data_parallel=3"]).trainer.data_parallel == 3
    with pytest.raises(ConfigError, match=r"queue.groups_per_step=12 is not divisible by trainer.data_parallel=4 "
                                          r"× trainer.minibatches=2"):
        load_config(None, [*megatron, "trainer.data_parallel=4"])
    with pytest.raises(ConfigError, match="trainer.data_parallel=2 needs trainer.backend = 'megatron'"):
        load_config(None, ["trainer.data_parallel=2"])


def absent_rank_worker(rank, world, port, out, parallelism, group):
    import json
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state

    from streamrl.megatron import parallel

    parallel.initialize(rank=rank, world_size=world, master_port=port, timeout_s=2, **{parallelism: world})
    if rank == 1:
        time.sleep(10)  # alive, but never joins the collective (a rank stuck or dead mid-step)
        return
    process_group = None if group == "world" else getattr(parallel_state, f"get_{group}_group")()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=process_group)
        outcome = "returned"
    except RuntimeError:
        outcome = "raised"
    with open(f"{out}/rank0.json", "w") as f:
        json.dump({"outcome": outcome, "waited_s": time.monotonic() - started}, f)


@pytest.mark.parametrize(("parallelism", "group"), [
    ("tensor_parallel", "world"),
    # megatron-core's own groups: created with its 30-minute default unless the timeout is passed on
    ("tensor_parallel", "tensor_model_parallel"),
    ("data_parallel", "data_parallel"),
    ("pipeline_parallel", "pipeline_model_parallel"),
])
def test_a_collective_without_its_other_rank_fails_after_the_timeout_instead_of_hanging(tmp_path, parallelism,
                                                                                        group):
    import json

    run_ranks(absent_rank_worker, 2, str(tmp_path), parallelism, group)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["outcome"] == "raised" and result["waited_s"] < 8


@pytest.mark.parametrize("installed", ["0.15.3", "0.17.1", "0.19.2", None])
def test_an_untested_megatron_core_is_refused_before_anything_starts(monkeypatch, installed):
    from packaging.version import Version

    from streamrl.config import ConfigError, load_config
    from streamrl.megatron import versions

    monkeypatch.setattr(versions, "installed_version", lambda: None if installed is None else Version(installed))
    expected = "not installed" if installed is None else rf"megatron-core {installed} is installed, but .* tested on"
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["trainer.backend=megatron"])
    with pytest.raises(RuntimeError, match=expected):  # and so does joining the trainer's process group
        from streamrl.megatron import parallel

        parallel.initialize()
    assert load_config(None, ["trainer.backend=torch"]).trainer.backend == "torch"  # only the backend that uses it


def test_the_tested_range_is_the_one_pyproject_pins_and_holds_what_is_installed():
    import tomllib

    from streamrl.megatron import versions

    lowest, untested = versions.TESTED
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"megatron-core>={lowest},<{untested}" in pins
    assert versions.check_megatron_core() == versions.installed_version()
