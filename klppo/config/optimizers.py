"""``optim.optimizer`` / ``optim.optimizer_impl`` / ``optim.override_optimizer_config`` (verl's keys):
which optimiser a model trains with, and what its state costs.

verl builds ``getattr(importlib.import_module(optimizer_impl), optimizer)(params, lr=..., weight_decay=...,
betas=... for Adam-like names, **override_optimizer_config)``; klppo builds the same (``run.setup.build_optimizer``,
with its decay groups: no decay on biases and norm weights), after checking here, before any model loads, that
the class exists and is an optimiser a PPO step can drive. ``torch.optim``'s classes need nothing installed;
``bitsandbytes.optim`` (``AdamW8bit``), ``torchao.optim`` (``AdamW8bit``, ``_AdamW``) or a module of your own work
where importable.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Optional

from klppo.config.problems import Problem

TORCH_OPTIM = "torch.optim"
# torch.optim's classes that an optimiser step of klppo's cannot drive.
CANNOT_TRAIN = {"LBFGS": "it re-evaluates the loss through a closure at every step, which a PPO step does not",
                 "SparseAdam": "it takes sparse gradients only, and a model's are dense",
                 "Muon": "it takes matrices only, and every model trains vectors too (biases, norm weights)"}
# fp32 floats of state per trainable parameter, by torch.optim's class name (its defaults): what klppo plan counts.
_STATE_FLOATS = {"AdamW": 2, "Adam": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
                 "Adagrad": 1, "ASGD": 1, "RMSprop": 1, "SGD": 0, "Adafactor": 0}


def takes_betas(name: str) -> bool:
    """verl's rule: Adam-like names (and AdEMAMix) get ``betas``."""
    return "adam" in name.lower() or "ademamix" in name.lower()


class OptimizerNotFound(ValueError):
    """``key`` (optimizer or optimizer_impl) names no optimiser a run can use; the message says why."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def optimizer_class(impl: str, name: str) -> type:
    """The class ``name`` of module ``impl``; ``OptimizerNotFound`` saying what is wrong and what there is instead."""
    import torch  # here: the config layer loads without torch (validate-config on a machine without it)

    try:
        module = importlib.import_module(impl)
    except ImportError as error:
        raise OptimizerNotFound("optimizer_impl", f"optimizer_impl = {impl!r} cannot be imported ({error}); install "
                                f"it (bitsandbytes, torchao) or use {TORCH_OPTIM}") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, torch.optim.Optimizer) and v is not torch.optim.Optimizer)
        raise OptimizerNotFound("optimizer", f"optimizer = {name!r} is not an optimiser class of {impl}; it has "
                                f"{', '.join(names) or 'none'}")
    if impl == TORCH_OPTIM and name in CANNOT_TRAIN:
        raise OptimizerNotFound("optimizer", f"optimizer = {name!r} cannot train here: {CANNOT_TRAIN[name]}; use "
                                "AdamW, Adam or SGD")
    return cls


def _class_problem(impl: str, name: str) -> Optional[tuple[str, str]]:
    """(the key, what is wrong) with an ``optim`` section's optimiser, or None. torch.optim's own classes are
    known by name, so validating a config imports no torch."""
    if impl == TORCH_OPTIM and name in _STATE_FLOATS:
        return None
    if impl != TORCH_OPTIM and importlib.util.find_spec(impl.split(".")[0]) is None:
        return "optimizer_impl", (f"optimizer_impl = {impl!r} is not installed; install it (pip install "
                                  f"{impl.split('.')[0]}) or use {TORCH_OPTIM}")
    try:
        optimizer_class(impl, name)
    except OptimizerNotFound as error:
        return error.key, str(error)
    return None


def optimizer_problems(impl: str, name: str, override: Optional[dict], prefix: str) -> list[Problem]:
    """What is wrong with an ``optim`` section's optimiser (``prefix``: the section's key): a class that
    cannot be found or cannot train, arguments it does not take."""
    out = []
    problem = _class_problem(impl, name)
    if problem is not None:
        key, message = problem
        out.append(Problem((f"{prefix}.{key}",), f"{prefix}.{message}"))
    untaken, taken = untaken_arguments(impl, name, override)
    if untaken:
        key = f"{prefix}.override_optimizer_config"
        out.append(Problem(tuple(f"{key}.{n}" for n in untaken), f"{key}: {impl}.{name} takes no argument "
                           f"{', '.join(repr(n) for n in untaken)}; remove it (it takes {', '.join(taken)})"))
    return out


def untaken_arguments(impl: str, name: str, override: Optional[dict]) -> tuple[list[str], list[str]]:
    """(the keys of ``override`` the optimiser's constructor does not take, the ones it does take), both
    empty where its class cannot be found (``_class_problem`` says why) or takes any keyword."""
    if not override:
        return [], []
    try:
        parameters = inspect.signature(optimizer_class(impl, name).__init__).parameters
    except (OptimizerNotFound, TypeError, ValueError):
        return [], []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return [], []
    taken = [n for n, p in parameters.items() if n not in ("self", "params") and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    return [key for key in override if key not in taken], taken


def optimizer_state_floats(impl: str, name: str, override: Optional[dict]) -> float:
    """fp32 floats of optimiser state per trainable parameter (klppo plan's count): torch.optim's by its
    class and the arguments that add state (momentum, amsgrad, centered); an 8-bit optimiser's two
    states at a byte each; anything else as AdamW (2)."""
    override = override or {}
    if impl != TORCH_OPTIM:
        return 0.5 if "8bit" in name.lower() else 0.25 if "4bit" in name.lower() else 2.0
    floats = _STATE_FLOATS.get(name, 2)
    if name in ("Adam", "AdamW") and override.get("amsgrad"):
        floats += 1
    if name in ("SGD", "RMSprop") and override.get("momentum", 0):
        floats += 1
    if name == "RMSprop" and override.get("centered"):
        floats += 1
    return float(floats)
