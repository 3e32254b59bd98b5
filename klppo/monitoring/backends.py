"""Optional metric sinks besides ``metrics.jsonl``: TensorBoard, Weights & Biases and MLflow.

Each is built from a ``trainer.logger`` entry. The package behind it is optional; a run that
names one that is not installed fails when its logger is built (before training) with the
``pip install`` that fixes it. This module imports neither package at import time, so the
config checks can ask ``missing_package`` without paying for either.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from klppo.errors import UserError
from klppo.monitoring.generations import GENERATIONS_KEY, Generation

# trainer.logger entries and the package each needs (None: nothing beyond klppo's own).
LOGGER_PACKAGES: dict[str, str | None] = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb",
                                          "mlflow": "mlflow"}
TENSORBOARD_DIR = "tensorboard"


class Backend(Protocol):
    def log(self, step: int, record: Mapping[str, float]) -> None: ...

    def log_generations(self, step: int, generations: Sequence[Generation]) -> None: ...

    def close(self) -> None: ...


def install_hint(logger: str) -> str:
    """What to do when the package behind a ``trainer.logger`` entry cannot be imported."""
    package = LOGGER_PACKAGES[logger]
    return (f"trainer.logger entry {logger!r} needs the {package} package, which is not installed: "
            f"pip install {package} (or pip install 'klppo[loggers]'), or remove {logger!r} from trainer.logger")


def missing_package(logger: str) -> str | None:
    """``install_hint`` for a known entry whose package is not installed, else None."""
    package = LOGGER_PACKAGES.get(logger)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return install_hint(logger)


class TensorBoardBackend:
    """Scalars into ``<run_dir>/tensorboard`` (one event file per run), read by ``tensorboard --logdir``."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch raises this when the tensorboard package is absent
            raise UserError(install_hint("tensorboard")) from exc
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def log(self, step: int, record: Mapping[str, float]) -> None:
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # one flush a step: a crash loses nothing a reader has not seen

    def log_generations(self, step: int, generations: Sequence[Generation]) -> None:
        """verl's text entry: each response's input, output and score, in Markdown."""
        text = f"**Generation Results - Step {step}**\n\n" + "".join(
            f"### Sample {i}\n**Input:** {g.input}\n\n**Output:** {g.output}\n\n**Score:** {g.score}\n\n---\n\n"
            for i, g in enumerate(generations, 1))
        self.writer.add_text(GENERATIONS_KEY, text, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run in ``<run_dir>/wandb``; offline unless ``WANDB_MODE`` says otherwise.

    Offline by default so that a run never needs a network or an account; upload it later
    with ``wandb sync <run_dir>/wandb/offline-run-*``.
    """

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: Mapping | None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise UserError(install_hint("wandb")) from exc
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project_name, name=experiment_name, dir=str(run_dir), config=dict(config or {}),
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="finish_previous",  # an SFT warm start and the PPO run after it are two W&B runs
        )
        self.generation_rows: list[list] = []  # log_generations' table, one row per validation

    def log(self, step: int, record: Mapping[str, float]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def log_generations(self, step: int, generations: Sequence[Generation]) -> None:
        """verl's table: a row per validation (step, then input, output and score of each response),
        the earlier validations' rows kept (W&B shows the table's latest version)."""
        import wandb

        columns = ["step"] + [f"{name}_{i}" for i in range(1, len(generations) + 1)
                              for name in ("input", "output", "score")]
        if self.generation_rows and len(self.generation_rows[0]) != len(columns):
            self.generation_rows = []  # fewer validation responses than asked for: a table of its own width
        self.generation_rows.append([step] + [v for g in generations for v in (g.input, g.output, g.score)])
        self.run.log({GENERATIONS_KEY: wandb.Table(columns=columns, data=list(self.generation_rows))}, step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow's limits: characters a metric key may hold, and a parameter value's length.
_MLFLOW_KEY_INVALID = re.compile(r"[^/\w.\- :]")
_MLFLOW_PARAM_CHARS = 6000


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts, as verl's adapter writes it: ``@`` as ``_at_``, runs of slashes as
    one, any other character MLflow refuses as ``_`` (``val-core/gsm8k/acc/mean@4`` -> ``..._at_4``)."""
    return _MLFLOW_KEY_INVALID.sub("_", re.sub("/+", "/", key.replace("@", "_at_")))


def mlflow_params(config: Mapping | None) -> dict[str, str]:
    """The run's config as MLflow parameters: dotted paths joined by ``/`` (verl's), a list as its
    length and its items by index, each value at most MLflow's 6,000 characters."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            flat[f"{prefix}/list_len"] = str(len(value))
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)
        else:
            flat[prefix] = str(value)[:_MLFLOW_PARAM_CHARS]

    walk("", dict(config or {}))
    return flat


class MlflowBackend:
    """An MLflow run: the step's metrics (keys made valid, ``mlflow_key``), the config as parameters
    and each validation's generations as a JSON artifact (verl's ``val_step<N>.json``).

    Where it goes: ``MLFLOW_TRACKING_URI`` (a server, a database), or by default a SQLite store in
    the run folder (``sqlite:///<run_dir>/mlflow.db``, artifacts in ``<run_dir>/mlruns``: read it with
    ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``), so a run needs no server. The
    experiment is ``trainer.project_name`` and the run ``trainer.experiment_name``, as in verl;
    ``MLFLOW_RUN_ID`` (set by Azure ML or Databricks) attaches to that run instead.
    """

    BATCH = 1000  # metrics per log_batch call (MLflow's limit)

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: Mapping | None) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise UserError(install_hint("mlflow")) from exc
        run_dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        if uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
            raise UserError(f"trainer.logger entry 'mlflow' writes to {uri}, which needs the sqlalchemy package: "
                            "pip install mlflow (or pip install sqlalchemy alembic beside mlflow-skinny), or set "
                            "MLFLOW_TRACKING_URI to a tracking server")
        self.client = MlflowClient(tracking_uri=uri)
        if os.environ.get("MLFLOW_RUN_ID"):
            self.run_id = os.environ["MLFLOW_RUN_ID"]
        else:
            experiment = self.client.get_experiment_by_name(project_name)
            experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
                project_name, artifact_location=(run_dir.resolve() / "mlruns").as_uri()
                if "MLFLOW_TRACKING_URI" not in os.environ else None)
            self.run_id = self.client.create_run(experiment_id, run_name=experiment_name).info.run_id
        params = [Param(k, v) for k, v in mlflow_params(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters per call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, step: int, record: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in record.items() if k != "step"]
        for start in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + self.BATCH])

    def log_generations(self, step: int, generations: Sequence[Generation]) -> None:
        """verl's artifact: ``val_step<step>.json``, a list of each response's input, output and score."""
        rows = [{"input": g.input, "output": g.output, "score": g.score} for g in generations]
        self.client.log_text(self.run_id, json.dumps(rows), f"val_step{step}.json")

    def close(self) -> None:
        if not os.environ.get("MLFLOW_RUN_ID"):  # a run someone else opened is theirs to end
            self.client.set_terminated(self.run_id)


def build_backends(
    loggers: list[str], run_dir: Path, project_name: str, experiment_name: str, config: Mapping | None
) -> list[Backend]:
    """The TensorBoard / W&B / MLflow sinks that ``loggers`` names (console and jsonl need none)."""
    unknown = [name for name in loggers if name not in LOGGER_PACKAGES]
    if unknown:
        raise UserError(f"trainer.logger entry {unknown[0]!r} is unknown; use a list of {', '.join(LOGGER_PACKAGES)}")
    out: list[Backend] = []
    try:
        if "tensorboard" in loggers:
            out.append(TensorBoardBackend(run_dir))
        if "wandb" in loggers:
            out.append(WandbBackend(run_dir, project_name, experiment_name, config))
        if "mlflow" in loggers:
            out.append(MlflowBackend(run_dir, project_name, experiment_name, config))
    except Exception:
        for backend in out:  # do not leave a half-built set of writers open
            backend.close()
        raise
    return out
