"""launch.train: a short end-to-end run of the digits MLP through the pipeline."""

import pytest

from launch import train as train_lib


def test_train_digits_mlp_learns_and_logs(tmp_path):
    # conftest.py already made 4 logical CPUs; train() re-asks for 4 (a no-op).
    config = train_lib.TrainConfig(
        epochs=1, stages=4, microbatches=2, batch_size=64, model_dir=str(tmp_path), verbose=0
    )
    result = train_lib.train(config)
    assert result["val_accuracy"] > 0.5
    assert result["step_time_ms"] > 0
    assert len(result["history"]["loss"]) == 1
    events = list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event files under {tmp_path}"


def test_unknown_dataset_names_valid_choices(tmp_path):
    config = train_lib.TrainConfig(dataset="no_such_data", model_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no_such_data") as err:
        train_lib.train(config)
    for name in train_lib.DATASETS:
        assert name in str(err.value)
