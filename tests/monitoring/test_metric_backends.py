"""TensorBoard and W&B sinks: what they write, and the one-line fix when their package is missing."""

import importlib.util
import sys

import pytest

from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.monitoring.logger import MetricsLogger, read_metrics

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]


def test_tensorboard_logger_writes_an_event_file_under_the_run_dir(tmp_path):
    with MetricsLogger(tmp_path, ["tensorboard"], print_fn=None) as logger:
        logger.log(1, {"actor/pg_loss": 0.5, "critic/score/mean": 0.25})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert read_metrics(tmp_path) == [{"step": 1, "actor/pg_loss": 0.5, "critic/score/mean": 0.25}]


def test_wandb_logger_writes_an_offline_run_without_a_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave sys.stdout alone for the other tests
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    logger = MetricsLogger(tmp_path / "run", ["console", "wandb"], print_fn=lambda _: None,
                           project_name="p", experiment_name="e", config={"algorithm": {"gamma": 1.0}})
    logger.log(1, {"actor/pg_loss": 0.5})
    logger.close()
    logger.close()  # idempotent
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))


def test_mlflow_logger_writes_a_run_in_the_run_folder_with_verls_keys_params_and_generations(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from klppo.monitoring.generations import GENERATIONS_KEY, Generation

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    logger = MetricsLogger(tmp_path / "run", ["mlflow"], print_fn=None, project_name="proj", experiment_name="exp",
                           config={"algorithm": {"gamma": 1.0}, "trainer": {"logger": ["console", "mlflow"]}})
    logger.log(1, {"actor/pg_loss": 0.5, "val-core/gsm8k/acc/mean@4": 0.25})
    logger.log(2, {"actor/pg_loss": 0.25, GENERATIONS_KEY: [Generation("1+1=", "2", "2", 1.0)]})
    logger.close()
    client = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [(1, 0.5), (2, 0.25)]
    assert client.get_metric_history(run.info.run_id, "val-core/gsm8k/acc/mean_at_4")[0].value == 0.25
    assert run.data.params == {"algorithm/gamma": "1.0", "trainer/logger/list_len": "2", "trainer/logger/0": "console",
                               "trainer/logger/1": "mlflow"}
    artifact = tmp_path / "run" / "mlruns"
    (written,) = artifact.rglob("val_step2.json")
    assert written.read_text() == '[{"input": "1+1=", "output": "2", "score": 1.0}]'
    assert read_metrics(tmp_path / "run")[0] == {"step": 1, "actor/pg_loss": 0.5, "val-core/gsm8k/acc/mean@4": 0.25}


@pytest.mark.parametrize("logger, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb"),
                                            ("mlflow", "mlflow.tracking")])
def test_a_missing_logger_package_is_a_user_error_naming_pip_install(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(UserError) as info:
        MetricsLogger(tmp_path, ["console", logger])
    message = str(info.value)
    assert f"pip install {logger}" in message and f"trainer.logger entry {logger!r}" in message
    assert "\n" not in message


def test_config_check_names_pip_install_for_a_missing_logger_package_before_any_model_loads(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))
    with pytest.raises(UserError) as info:
        load_ppo_config(None, REQUIRED + ["trainer.logger=[console,tensorboard,wandb,tensorbord]"])
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 2
    assert "trainer.logger entry 'wandb' needs the wandb package" in lines[0] and "pip install wandb" in lines[0]
    assert "trainer.logger entry 'tensorbord': unknown logger (did you mean 'tensorboard'?)" in lines[1]


def test_all_five_loggers_pass_the_config_check_when_installed():
    cfg = load_ppo_config(None, REQUIRED + ["trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]"])
    assert cfg.trainer.logger == ["console", "jsonl", "tensorboard", "wandb", "mlflow"]


def test_metrics_become_the_floats_item_gives_in_one_copy_per_device(monkeypatch):
    import torch

    from klppo.monitoring.logger import to_floats

    metrics = {"a": torch.tensor(0.1), "n": 3, "b": torch.tensor(7, dtype=torch.int64), "c": torch.tensor(1 / 3).bfloat16(),
               "d": torch.tensor(True), "e": 0.25, "f": torch.tensor([2.5], dtype=torch.float64)}
    expected = {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: copies.append(1) or tolist(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("one .item() per metric"))
    got = to_floats(metrics)
    assert got == expected and list(got) == list(metrics) and copies == [1]
    assert all(type(v) is float for v in got.values())
