"""Rule rewards: the built-in ones chosen by ``data_source``, or the user's own function.

A reward function has verl's signature
``f(data_source, solution_str, ground_truth, extra_info) -> float`` and is called with
keyword arguments, as verl calls it, so verl users' files work unchanged; the config's
``reward_kwargs`` are passed on every call too (winning over the four, as in verl). It may return
a number or (as verl allows) a dict with a ``"score"`` key; NaN passes through, for the run's
guard to count (``trainer.guard.max_nonfinite_steps``). An ``async def`` function (one that
waits on a judge model or a sandbox) is awaited for all of a batch's responses at once.

A user's function is checked when it loads (it must accept verl's four keyword arguments),
and whatever it raises or returns wrongly during a step is one ``UserError`` naming the
function, its file and (``score_responses``' ``places``) the prompt's file and row.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klppo.errors import UserError
from klppo.rewards import gsm8k

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
KNOWN_DATA_SOURCES = GSM8K_SOURCES
# How verl's reward managers call the function: these keywords, every time.
VERL_CALL = "compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """The built-in rule reward for ``data_source`` (verl's default_compute_score, GSM8K part)."""
    if data_source in GSM8K_SOURCES:
        if ground_truth is None:
            raise UserError(
                f"data_source '{data_source}' is scored against reward_model.ground_truth, but a row has none; "
                "add reward_model={'style': 'rule', 'ground_truth': ...} to every row"
            )
        if not gsm8k.is_answer(ground_truth):  # no response could ever match it: every score would be 0
            raise UserError(
                f"data_source '{data_source}' compares the number after '#### ' with reward_model.ground_truth, but a "
                f"row's is {str(ground_truth)[:60]!r}, which no answer can equal; give the final number alone "
                "(verl's gsm8k preprocessing keeps what follows '#### ')"
            )
        return gsm8k.compute_score(solution_str, ground_truth)
    raise UserError(
        f"no built-in reward for data_source '{data_source}' (known: {', '.join(KNOWN_DATA_SOURCES)}); "
        "set custom_reward_function.path to a Python file defining "
        "compute_score(data_source, solution_str, ground_truth, extra_info)"
    )


def _first_line(exc: BaseException) -> str:
    """``"KeyError: 'answer'"``: an exception of the user's code as one line."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_file(path: str, module_name: str, key: str = "custom_reward_function"):
    """Execute the file as module ``module_name``, registered in sys.modules so its functions pickle."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{key}.path '{path}' cannot be imported; point it at a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # the user's code (an exit() in it too): one line, the cause chained
        del sys.modules[module_name]
        raise UserError(f"{key}.path '{path}' failed to import ({_first_line(e)}); fix the file") from e
    return module


def load_custom_reward_function(path: str, name: str, key: str = "custom_reward_function",
                                 reward_kwargs: Mapping[str, Any] | None = None) -> Callable:
    """Import the Python file at ``path`` (once per process) and return its function ``name``.

    ``key``: the config section the messages name (``trainer.gold_reward`` loads one too);
    ``reward_kwargs``: what each call passes besides verl's four keywords.
    """
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{key}.path '{path}' not found; point it at a Python file")
    module_name = "klppo_custom_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name) or _import_file(path, module_name, key)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(
            f"{key}.name '{name}' is not defined in '{path}' (callables there: "
            f"{', '.join(found) or 'none'}); set {key}.name to one of them"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise UserError(
            f"{key}.name '{name}' in '{path}' is a {type(fn).__name__}, not a function; "
            f"set {key}.name to a function"
        )
    check_reward_signature(fn, f"{key}.name '{name}' in '{path}'", reward_kwargs or {}, f"{key}.reward_kwargs")
    return fn


def check_reward_signature(fn: Callable, what: str, reward_kwargs: Mapping[str, Any] | None = None,
                           kwargs_key: str = "custom_reward_function.reward_kwargs") -> None:
    """Refuse, before training, a function that cannot be called as verl calls it (``VERL_CALL``,
    plus ``reward_kwargs``, which ``kwargs_key`` sets).

    Binding the keywords to the signature is exactly the call's own check, made without running
    the function; a callable whose signature Python cannot read (some builtins) is let through,
    to fail at its first call instead.
    """
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise UserError(f"{what} is a generator function, but klppo calls it and uses what it returns, as verl's "
                        "reward managers do; make it a function (plain or async def) that returns the score")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    extra = dict(reward_kwargs or {})
    try:
        signature.bind(**{"data_source": "", "solution_str": "", "ground_truth": None, "extra_info": {}, **extra})
    except TypeError as exc:
        taken = [name for name in extra if not _accepts(signature, name)]
        if taken:
            them = "them" if len(taken) > 1 else "it"
            raise UserError(f"{what} takes {signature}, which has no parameter {', '.join(map(repr, taken))} that "
                            f"{kwargs_key} passes on every call; add {them} (or **kwargs) to the function, or remove "
                            f"{them} from {kwargs_key}") from None
        raise UserError(
            f"{what} takes {signature}, but klppo calls it as verl does, {VERL_CALL} ({exc}); give it those "
            "four parameters (extra_info=None may have a default), or add **kwargs"
        ) from None


def _accepts(signature: inspect.Signature, name: str) -> bool:
    kinds = {p.kind for p in signature.parameters.values()}
    parameter = signature.parameters.get(name)
    return inspect.Parameter.VAR_KEYWORD in kinds or (
        parameter is not None and parameter.kind is not inspect.Parameter.POSITIONAL_ONLY)


def _as_float(value: Any, where: str) -> float:
    """A number, or a dict with a "score" key (verl allows both), as a float; NaN passes through."""
    if isinstance(value, dict):
        if "score" not in value:
            raise UserError(
                f"{where} returned a dict without a 'score' key (keys: {', '.join(map(str, value))}); "
                "return a number or a dict with 'score'"
            )
        value = value["score"]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise UserError(f"{where} returned {value!r} ({type(value).__name__}); return a number")
    try:
        return float(value)
    except (TypeError, ValueError) as e:  # e.g. a tensor of several elements
        raise UserError(f"{where} returned {value!r} ({type(value).__name__}); return a single number") from e


def reward_components(value: Any) -> dict[str, float]:
    """The numeric entries besides "score" of a dict a reward function returned (verl's
    ``reward_extra_info``, e.g. ``{"score": 1.2, "exact_match": 1.0, "length_bonus": 0.2}``);
    {} for a plain number. A bool counts 1 or 0 (verl's math_dapo returns ``"acc": True``, the
    entry its DAPO recipe filters groups by); text and other entries (verl's "pred") are no components."""
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}


@dataclass
class RewardFunction:
    """A reward function plus the name its errors use; calls return a float."""

    fn: Callable
    # "default_compute_score" or "custom_reward_function compute_score in 'x.py'".
    name: str
    # Passed on every call besides verl's four keywords, winning over them (verl's reward_kwargs).
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_async(self) -> bool:
        """An ``async def`` function: ``score_responses`` awaits a batch's calls together."""
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
        return self.score(data_source, solution_str, ground_truth, extra_info)[0]

    def score(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None
              ) -> tuple[float, dict[str, float]]:
        """The score, and the components of a dict return (``reward_components``)."""
        try:
            value = self.fn(**self.arguments(data_source, solution_str, ground_truth, extra_info))
            if inspect.isawaitable(value):  # one call alone; score_responses awaits a batch's together
                value = asyncio.run(_awaited(value))
        except (Exception, SystemExit) as exc:  # the user's code (an exit() in it too): one line, the cause chained
            failure = self.failure(exc, data_source)
            if failure is None:
                raise
            raise failure from exc
        return self.result(value, data_source)

    def arguments(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> dict:
        """The keyword arguments of one call, as verl's reward managers pass them."""
        return {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                "extra_info": extra_info if extra_info is not None else {}, **self.kwargs}

    def result(self, value: Any, data_source: str) -> tuple[float, dict[str, float]]:
        return _as_float(value, f"reward function {self.name} (data_source '{data_source}')"), reward_components(value)

    def failure(self, exc: BaseException, data_source: str) -> UserError | None:
        """The one-line error for an exception of the function, or None to raise it as it is: the
        built-in rules' own UserError is worded for the user already, a MemoryError is the machine's."""
        if isinstance(exc, (MemoryError, UserError)):
            return None
        return UserError(f"reward function {self.name} raised {_first_line(exc)} (data_source '{data_source}'); "
                         "fix the function, or catch the case and return a score")


async def _awaited(awaitable) -> Any:
    return await awaitable


def make_reward_fn(custom_path: str | None, custom_name: str = "compute_score",
                   key: str = "custom_reward_function", reward_kwargs: Mapping[str, Any] | None = None
                   ) -> RewardFunction:
    """The user's function at ``custom_path`` when given, else the built-in rules by data_source
    (``key``: the config section that names the file; ``reward_kwargs``: its ``reward_kwargs``)."""
    if custom_path:
        fn = load_custom_reward_function(custom_path, custom_name, key, reward_kwargs)
        return RewardFunction(fn, f"{key} {custom_name} in '{custom_path}'", dict(reward_kwargs or {}))
    return RewardFunction(default_compute_score, "default_compute_score")


def check_scorable(reward_fn: RewardFunction, sources_and_truths: Sequence[tuple[str, Any]], key: str,
                   places: Sequence[str] | None = None) -> None:
    """Up front, before any model loads: the built-in rules know every data_source and have a truth
    that an answer can match.

    A custom function is the user's to check; ``key`` names the data files in the message, and
    ``places`` (one per prompt, e.g. "x.parquet row 5") the file and row of each prompt.
    """
    if reward_fn.fn is not default_compute_score:
        return
    for index, (source, truth) in enumerate(sources_and_truths):
        try:
            default_compute_score(source, "", truth)  # its own checks of the row, on an empty response
        except UserError as exc:
            where = places[index] if places and places[index] else f"prompt {index}"
            raise UserError(f"{key}, {where}: {exc}") from None


def score_responses(
    reward_fn: Callable[..., float],
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None],
    places: Sequence[str] | None = None,
) -> list[float]:
    """One score per response: ``reward_fn(data_source, response, ground_truth, extra_info)``.

    ``places`` (one per response, e.g. "x.parquet row 5": its prompt's file and row) lead the
    message of a ``UserError`` the function raises.
    """
    return score_responses_with_components(reward_fn, data_sources, responses, ground_truths, extra_infos, places)[0]


def score_responses_with_components(
    reward_fn: Callable[..., float],
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None],
    places: Sequence[str] | None = None,
) -> tuple[list[float], list[dict[str, float]]]:
    """``score_responses``' scores, and each response's reward components ({} where the function
    returns a number, or ``reward_fn`` is a plain callable rather than a ``RewardFunction``)."""
    n = len(responses)
    assert len(data_sources) == len(ground_truths) == len(extra_infos) == n, "score_responses: length mismatch"
    assert places is None or len(places) == n, "score_responses: one place per response"
    calls = list(zip(data_sources, responses, ground_truths, extra_infos))
    if isinstance(reward_fn, RewardFunction) and reward_fn.is_async:
        returned = asyncio.run(_all_returns(reward_fn, calls))
    scores, components = [], []
    for i, (source, text, truth, info) in enumerate(calls):
        try:
            if isinstance(reward_fn, RewardFunction) and reward_fn.is_async:
                value = returned[i]
                if isinstance(value, _Raised):
                    failure = reward_fn.failure(value.exc, source)
                    if failure is None:
                        raise value.exc
                    raise failure from value.exc
                score, parts = reward_fn.result(value, source)
            elif isinstance(reward_fn, RewardFunction):
                score, parts = reward_fn.score(source, text, truth, info)
            else:
                score, parts = reward_fn(source, text, truth, info), {}
        except UserError as exc:
            if places is None or not places[i]:
                raise
            raise UserError(f"{places[i]}: {exc}") from exc.__cause__
        scores.append(score)
        components.append(parts)
    return scores, components


@dataclass
class _Raised:
    exc: BaseException


async def _all_returns(reward_fn: RewardFunction, calls: list[tuple]) -> list[Any]:
    """What each call of an async reward function returned (or ``_Raised``), awaited together."""
    async def one(call: tuple) -> Any:
        try:
            return await reward_fn.fn(**reward_fn.arguments(*call))
        except (Exception, SystemExit) as exc:  # as a plain function's: one line per failure, in the batch's order
            return _Raised(exc)

    return await asyncio.gather(*(one(call) for call in calls))
