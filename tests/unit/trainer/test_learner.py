"""One `Learner` protocol: every learner the trainer shell can step has each of its members, called the
same way; the torch and megatron trainers are the one `Trainer` over two backends."""

import inspect

import pytest

from streamrl.sim.workload import SimWorkload
from streamrl.trainer.learner import Learner, ModuleBackend, Trainer
from streamrl.trainer.ranks import RankGroup
from streamrl.trainer.sim import SimLearner
from streamrl.trainer.step import Backend

METHODS = [name for name, member in vars(Learner).items() if inspect.isfunction(member) and not name.startswith("_")]
ATTRIBUTES = list(Learner.__annotations__)


def parameters(function):
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[1:]]


@pytest.mark.parametrize("learner", [Trainer, RankGroup, SimLearner], ids=lambda c: c.__name__)
def test_every_learner_has_every_member_of_the_protocol_with_its_parameters(learner):
    assert {"train", "weights", "evaluate", "save", "load_optimizer", "offload", "onload"} <= set(METHODS)
    for name in METHODS:
        assert parameters(getattr(learner, name)) == parameters(getattr(Learner, name)), name


def test_every_learner_carries_the_version_and_tokenizer(tiny_model_dir):
    from streamrl.config import TrainerSection
    from streamrl.correction import LossConfig
    from streamrl.trainer.torch_trainer import TorchTrainer

    trainer = TorchTrainer(tiny_model_dir, trainer=TrainerSection(), loss=LossConfig(), group_size=4)
    sim = SimLearner(SimWorkload())
    for instance in (trainer, sim):
        assert all(hasattr(instance, name) for name in ATTRIBUTES)
    assert trainer.tokenizer is trainer.backend.tokenizer and sim.tokenizer is None
    assert all(isinstance(getattr(RankGroup, name), property) for name in ATTRIBUTES)


def test_the_torch_and_megatron_trainers_are_the_one_trainer_over_two_backends():
    from streamrl.trainer.megatron_trainer import MegatronBackend, MegatronTrainer
    from streamrl.trainer.torch_trainer import TorchBackend, TorchTrainer

    for trainer in (TorchTrainer, MegatronTrainer):
        assert trainer.__bases__ == (Trainer,)
        assert set(vars(trainer)) - {"__module__", "__qualname__", "__doc__", "__firstlineno__",
                                     "__static_attributes__"} == {"__init__"}  # a constructor, no override
    step_members = [name for name, member in vars(Backend).items() if inspect.isfunction(member) and not name.startswith("_")]
    for backend in (TorchBackend, MegatronBackend):
        assert issubclass(backend, ModuleBackend)
        for name in step_members:
            assert parameters(getattr(backend, name)) == parameters(getattr(Backend, name)), (backend, name)
