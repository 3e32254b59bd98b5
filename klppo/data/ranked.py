"""Ranked-response datasets: prompts with several recorded responses and who preferred which.

Columns (one row per prompt, verl-style):
  prompt        list of chat messages ``{"role", "content"}``, or plain text (a string; no chat
                template); name set by ``data.prompt_key``. Files may mix the forms, each row
                encoded by its own (``rl_dataset.encode_prompts``)
  responses     list of str, at least 2: the recorded responses being ranked
  and exactly one of the ranking forms, per row:
  ranking       list of int: response indices (0-based), best first; may be partial
  rankings      list of such lists: one ranking per annotator
  scores        list of float: one finite score per response (higher is better)
  chosen, rejected  two str: a preference pair; then ``responses`` is left empty (null) and
                is read as [chosen, rejected] with ranking [0, 1]
  and optionally, as in RL prompt files (``rl_dataset``):
  data_source   str, picks the reward function
  reward_model  ``{"style", "ground_truth"}``; ``ground_truth`` is kept
  extra_info    dict
  rollout_log_probs  list of lists of float: the behaviour policy's per-token log-probs of each
                response, aligned with ``responses`` ([chosen, rejected] for a pair); see
                ``klppo.data.rollout_log_probs``

Rows of one file may use different ranking forms. A partial ranking ranks only the responses
it lists among themselves (the convention of ``klppo.algo.ranking``). Scores become a ranking
by descending score; equal scores keep their order in ``responses`` (a stable sort), and the
scores are kept so that consumers which must treat equal scores as ties can. chosen == rejected
is allowed (it carries no preference but is not malformed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from klppo.data import rollout_log_probs as behaviour
from klppo.data.parquet import EVERY_ROW, RowSample, read_parquet_rows, row_error, row_place, short_repr
from klppo.data.rl_dataset import (
    check_data_source,
    check_extra_info,
    check_ground_truth,
    check_prompt,
    check_responses,
    check_truncation,
    encode_prompts,
    fit_prompts,
)
from klppo.errors import UserError

RANKING_FORMS = ("ranking", "rankings", "scores", "chosen/rejected")
ONE_FORM_FIX = "give exactly one of 'ranking', 'rankings', 'scores' or 'chosen'+'rejected' per row"
RANKING_FIX = "write a ranking as a list of 0-based indices into 'responses', best first, e.g. [2, 0, 1]"


@dataclass
class RankedRecord:
    """One validated, tokenised prompt with its ranked responses."""

    # Position in the dataset after filtering.
    index: int
    # The chat messages, each reduced to {"role", "content"}; or the plain-text prompt.
    raw_prompt: list[dict] | str
    # The prompt's tokens (``rl_dataset.encode_prompts``), after truncation; at most max_prompt_length.
    prompt_ids: list[int]
    # The recorded responses, at least 2 ([chosen, rejected] for a preference pair).
    responses: list[str]
    # One ranking per annotator: indices into `responses`, best first, each listing >= 2
    # distinct responses (partial rankings allowed). From `scores`: one full ranking by
    # descending score, equal scores in response order.
    rankings: list[list[int]]
    # One score per response when the row gave `scores`, else None.
    scores: list[float] | None
    # Picks the reward function, or None when the row has none.
    data_source: str | None
    # reward_model["ground_truth"], or None when the row has none.
    ground_truth: Any
    # The row's extra_info ({} when absent).
    extra_info: dict
    # Per response, the behaviour policy's log-prob of each of its tokens (closing EOS included), or None.
    rollout_log_probs: list[list[float]] | None = None
    # The file and row it came from ("x.parquet row 3"), for messages about it.
    where: str = ""


def _ranking_form(row: dict) -> str:
    """Which of RANKING_FORMS the row uses; a UserError unless exactly one has a value."""
    present = [c for c in ("ranking", "rankings", "scores") if row.get(c) is not None]
    if row.get("chosen") is not None or row.get("rejected") is not None:
        present.append("chosen/rejected")
    if not present:
        raise row_error(row, "ranking", "no ranking given: none of the columns 'ranking', 'rankings', 'scores', "
                        "'chosen'/'rejected' has a value", ONE_FORM_FIX)
    if len(present) > 1:
        names = " and ".join(f"'{c}'" for c in present)
        raise row_error(row, present[1].split("/")[0], f"{names} are given together, so which one ranks the "
                        "responses is ambiguous", ONE_FORM_FIX)
    return present[0]


def check_pair(row: dict) -> list[str]:
    """The [chosen, rejected] responses of a preference-pair row."""
    for key in ("chosen", "rejected"):
        value = row.get(key)
        if not isinstance(value, str):
            raise row_error(row, key, f"expected the {key} response as a string, got {short_repr(value)}",
                            "give both 'chosen' and 'rejected' as strings")
    if row.get("responses") is not None:
        raise row_error(row, "responses", "given together with 'chosen'/'rejected'",
                        "leave 'responses' empty for a preference pair, or drop 'chosen'/'rejected' and "
                        "add a 'ranking' of the responses")
    return [row["chosen"], row["rejected"]]


def _check_ranking(row: dict, column: str, value: Any, n_responses: int, label: str) -> list[int]:
    """Validate one ranking (``label`` names it in messages) against ``n_responses`` responses."""
    if not isinstance(value, list):
        raise row_error(row, column, f"{label} is {short_repr(value)}, not a list of response indices", RANKING_FIX)
    if len(value) < 2:
        raise row_error(row, column, f"{label} {short_repr(value)} lists {len(value)} response(s); a ranking "
                        "needs at least 2", RANKING_FIX)
    if len(value) > n_responses:
        raise row_error(row, column, f"{label} has {len(value)} entries but the row has {n_responses} responses",
                        "list each response at most once")
    seen = set()
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int):
            raise row_error(row, column, f"{label} {short_repr(value)} has entry {short_repr(i)}, not an integer "
                            "index", RANKING_FIX)
        if not 0 <= i < n_responses:
            raise row_error(row, column, f"{label} has index {i}, out of range for {n_responses} responses "
                            f"(valid 0..{n_responses - 1})", "indices are 0-based positions in 'responses'")
        if i in seen:
            raise row_error(row, column, f"{label} {short_repr(value)} lists response {i} twice",
                            "list each response at most once")
        seen.add(i)
    return list(value)


def _check_annotator_rankings(row: dict, n_responses: int) -> list[list[int]]:
    """Validate the ``rankings`` column: a non-empty list of rankings, one per annotator."""
    value = row["rankings"]
    if not isinstance(value, list) or not value:
        raise row_error(row, "rankings", f"expected a non-empty list of rankings (one per annotator), got "
                        f"{short_repr(value)}", "write it like [[2, 0, 1], [0, 2]]")
    return [_check_ranking(row, "rankings", r, n_responses, f"ranking {k}") for k, r in enumerate(value)]


def check_ranked_row(row: dict) -> tuple[list[str], list[list[int]], list[float] | None]:
    """Validate the responses and ranking of one row: (responses, rankings, scores)."""
    form = _ranking_form(row)
    if form == "chosen/rejected":
        return check_pair(row), [[0, 1]], None
    responses, scores = check_responses(row, required=True)
    if len(responses) < 2:
        raise row_error(row, "responses", f"has {len(responses)} response, but a ranking needs at least 2",
                        "add responses to this row or drop it")
    if form == "ranking":
        return responses, [_check_ranking(row, "ranking", row["ranking"], len(responses), "ranking")], None
    if form == "rankings":
        return responses, _check_annotator_rankings(row, len(responses)), None
    assert scores is not None, "form 'scores' implies a scores value"
    order = sorted(range(len(responses)), key=lambda i: -scores[i])  # stable: ties keep response order
    return responses, [order], scores


def load_ranked_dataset(
    files: str | Sequence[str],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    require_rollout_log_probs: behaviour.LogProbsNeed | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    sample: RowSample = EVERY_ROW,
    log: Callable[[str], None] = print,
) -> list[RankedRecord]:
    """Read, validate and tokenise ranked-response rows; returns one ``RankedRecord`` per kept row.

    Every row is checked before any is tokenised; the first bad value raises a one-line
    ``UserError`` naming the file, row and column. Over-long prompts are handled as in
    ``load_rl_dataset``: dropped when ``filter_overlong_prompts``, else cut per ``truncation``
    ("left" keeps the end, "right" keeps the start) or rejected ("error").
    ``require_rollout_log_probs``: every row must carry its responses' behaviour log-probs, for this need.
    """
    check_truncation(truncation)
    if max_prompt_length <= 0:
        raise UserError(f"data.max_prompt_length is {max_prompt_length}; set it to a positive number of tokens")
    rows = read_parquet_rows(files, [prompt_key], sample)
    checked = []
    for row in rows:
        prompt = check_prompt(row, prompt_key)
        responses, rankings, scores = check_ranked_row(row)
        source = None if row.get("data_source") is None else check_data_source(row)
        log_probs = behaviour.check_rollout_log_probs(row, responses, require_rollout_log_probs)
        checked.append((row, prompt, responses, rankings, scores, source, check_ground_truth(row),
                        check_extra_info(row), log_probs))
    behaviour.check_lengths([(c[0], c[2], c[8]) for c in checked], tokenizer)
    all_ids = encode_prompts(tokenizer, [c[1] for c in checked], rows, prompt_key, template_kwargs)
    kept = fit_prompts([c[0] for c in checked], all_ids, prompt_key=prompt_key, max_prompt_length=max_prompt_length,
                       truncation=truncation, filter_overlong_prompts=filter_overlong_prompts, files=files, log=log,
                       what="ranked prompts")
    records = []
    for position, ids in kept:
        row, prompt, responses, rankings, scores, source, truth, extra, log_probs = checked[position]
        records.append(RankedRecord(len(records), prompt, ids, responses, rankings, scores, source, truth, extra,
                                    log_probs, where=row_place(row)))
    return records


def ranking_tiers(ranking: list) -> list[list[int]]:
    """A ranking (best first; an entry may be a list of tied items) as a list of tiers."""
    return [list(entry) if isinstance(entry, (list, tuple)) else [entry] for entry in ranking]


def ranked_pairs(rankings: list[list]) -> list[tuple[int, int]]:
    """(better, worse) for every pair of differently ranked responses, per annotator; ties give none."""
    pairs = []
    for ranking in rankings:
        tiers = ranking_tiers(ranking)
        for a, upper in enumerate(tiers):
            pairs += [(i, j) for lower in tiers[a + 1 :] for i in upper for j in lower]
    return pairs
