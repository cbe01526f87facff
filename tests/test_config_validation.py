"""HybridConfig.validate(): every bad value raises ValueError naming the field, at construction and
when validate() is called again after a field was changed, never a failure deep inside a trainer."""
import dataclasses

import pytest
import torch

from hybrid_trainer import HybridConfig, HybridTrainer
from hybrid_trainer.config import MAX_DYNAMICS_BATCH, MAX_DYNAMICS_WINDOW, MAX_PREDICT_LENGTH, MAX_SEED

BAD_VALUES = [
    ("predict_lengths", 4, r"HybridConfig.predict_lengths=4: must be a non-empty tuple \(or list\) of distinct ints"),
    ("predict_lengths", "48", r"HybridConfig.predict_lengths='48': must be a non-empty tuple"),
    ("predict_lengths", None, r"HybridConfig.predict_lengths=None"),
    ("predict_lengths", (2**40,), r"HybridConfig.predict_lengths=\(1099511627776,\): .*ints in \[1, 1024\]"),
    ("predict_lengths", (4, MAX_PREDICT_LENGTH + 1), r"HybridConfig.predict_lengths=.*in \[1, 1024\]"),
    ("predict_lengths", (4, 4), r"distinct"),
    ("seed", 2**70, r"HybridConfig.seed=1180591620717411303424: must be an int in \[0, 2\*\*63 - 1\]"),
    ("seed", MAX_SEED + 1, r"HybridConfig.seed="),
    ("seed", -1, r"HybridConfig.seed=-1"),
    ("seed", 1.0, r"HybridConfig.seed=1.0"),
    ("dynamics_batch", 2**40, r"HybridConfig.dynamics_batch=1099511627776: must be an int in \[1, 4096\]"),
    ("dynamics_window", MAX_DYNAMICS_WINDOW + 1, r"HybridConfig.dynamics_window=257: must be an int in \[1, 256\]"),
    ("divergence", {"windw": 5}, r"HybridConfig.divergence=\{'windw': 5\}: not valid DivergenceMonitor keyword "
                                 r"arguments: .*windw"),
    ("divergence", {"window": 1}, r"HybridConfig.divergence=\{'window': 1\}: .*window"),
    ("divergence", {"loss_z_warning": 5.0, "loss_z_critical": 2.0}, r"HybridConfig.divergence=.*loss_z_critical"),
    ("divergence", {1: 2}, r"HybridConfig.divergence=\{1: 2\}"),
    ("divergence", [("window", 5)], r"HybridConfig.divergence=\[\('window', 5\)\]: must be a dict"),
]


@pytest.mark.parametrize("field, value, match", BAD_VALUES)
def test_bad_value_at_construction_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        HybridConfig(**{field: value})


@pytest.mark.parametrize("field, value, match", BAD_VALUES)
def test_bad_value_set_later_is_caught_by_validate(field, value, match):
    """Fields are plain attributes: validate() must check them again, with the same error."""
    config = HybridConfig()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        config.validate()


@pytest.mark.parametrize("field, value, match", BAD_VALUES)
def test_bad_value_from_json_names_the_field(field, value, match):
    data = HybridConfig().to_dict()
    data[field] = value
    if field == "divergence" and not isinstance(value, dict):
        return  # a list of pairs has no JSON dict form to come from
    with pytest.raises(ValueError, match=match):
        HybridConfig.from_dict(data)


def test_edges_of_the_bounds_are_accepted():
    config = HybridConfig(predict_lengths=[1, MAX_PREDICT_LENGTH], seed=MAX_SEED, dynamics_batch=MAX_DYNAMICS_BATCH,
                          dynamics_window=MAX_DYNAMICS_WINDOW, divergence={"window": 30, "min_history": 5})
    assert config.predict_lengths == (1, MAX_PREDICT_LENGTH)  # a list (as JSON gives) becomes a tuple
    assert HybridConfig(predict_lengths=range(2, 5)).predict_lengths == (2, 3, 4)
    assert HybridConfig.from_json(config.to_json()) == config


def test_largest_seed_runs_a_trainer():
    """The bound is what the trainer's generators take: seed + 1 seeds the replay sampler."""
    model = torch.nn.Linear(4, 2)
    config = HybridConfig(seed=MAX_SEED, predict=True, dynamics_hidden=8)
    trainer = HybridTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda m, batch: m(batch).square().mean(), config=config)
    trainer.step(torch.randn(3, 4))

