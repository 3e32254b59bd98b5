"""The ``rollout_log_probs`` column: the behaviour policy's per-token log-probs of recorded responses.

Named as verl names the log-probs its rollout records. A row's value is null (its responses
carry none) or a list with one list of floats per response, aligned with ``responses`` (for a
``chosen``/``rejected`` pair: [chosen, rejected]). Each inner list holds one log-prob (a
finite number <= 0) per token of the response as klppo tokenises it: the text encoded
without special tokens, then the closing EOS, so its length is the token count + 1 (the EOS
is a token the behaviour policy chose, and PPO trains on it). A response that training cuts
at ``max_response_length`` has its log-probs cut with it. ``klppo score-logprobs`` fills the
column by scoring the responses with a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from klppo.data.parquet import row_error, short_repr
from klppo.errors import UserError

COLUMN = "rollout_log_probs"
FILL_FIX = ("fill the column with `klppo score-logprobs --model MODEL_DIR --input IN.parquet --output OUT.parquet` "
            "(MODEL_DIR: the policy that wrote the responses, e.g. the SFT model)")


def encode_responses(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """Each response's token ids as klppo trains on them, before any cut: no special tokens, then EOS."""
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos_token; set eos_token in the model's tokenizer_config.json")
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    return [list(ids) + [tokenizer.eos_token_id] for ids in encoded]


@dataclass(frozen=True)
class LogProbsNeed:
    """What makes every row's behaviour log-probs required, as the error for a row without them says it."""

    setting: str  # the config setting that reads them, e.g. "algorithm.rollout_correction"
    without: str  # how to run without them, e.g. "switch the correction off"


def check_rollout_log_probs(row: dict, responses: list[str] | None, required: LogProbsNeed | None
                            ) -> list[list[float]] | None:
    """The row's log-prob lists (one per response, values checked), or None where it has none
    (refused when ``required``: a row without them would be weighed as if mu were 1).

    Lengths against the tokenised responses are checked by ``check_lengths``, in one batch.
    """
    value = row.get(COLUMN)
    if value is None:
        if required is not None:
            raise row_error(row, COLUMN, f"no behaviour log-probs for this row's responses, which {required.setting} "
                            "needs for every row", f"{FILL_FIX}, or {required.without}")
        return None
    if responses is None:
        raise row_error(row, COLUMN, "log-probs given without responses", "add a 'responses' column or drop this one")
    fix = f"give one list of per-token log-probs per response; {FILL_FIX}"
    if not isinstance(value, list) or len(value) != len(responses):
        raise row_error(row, COLUMN, f"expected a list of {len(responses)} lists (one per response), got "
                        f"{short_repr(value)}", fix)
    for i, log_probs in enumerate(value):
        if not isinstance(log_probs, list):
            raise row_error(row, COLUMN, f"entry {i} is {short_repr(log_probs)}, not a list of numbers", fix)
        for t, x in enumerate(log_probs):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 0:
                raise row_error(row, COLUMN, f"response {i}, token {t}: {short_repr(x)} is not a log-prob (a "
                                "finite number <= 0)", fix)
    return [[float(x) for x in log_probs] for log_probs in value]


def check_lengths(checked: Sequence[tuple[dict, list[str], list[list[float]] | None]], tokenizer) -> None:
    """Every log-prob list has one entry per token of its response (closing EOS included).

    ``checked``: (row, responses, log-probs or None) per row; rows without log-probs are skipped.
    """
    with_log_probs = [(row, responses, lps) for row, responses, lps in checked if lps is not None]
    texts = [text for _, responses, _ in with_log_probs for text in responses]
    counts = iter(len(ids) for ids in encode_responses(texts, tokenizer))
    for row, responses, log_probs in with_log_probs:
        for i, lps in enumerate(log_probs):
            n_tokens = next(counts)
            if len(lps) != n_tokens:
                raise row_error(row, COLUMN, f"response {i} has {len(lps)} log-probs but {n_tokens} tokens as this "
                                "model's tokenizer encodes it (its text without special tokens, then the closing "
                                "EOS)", f"score the responses with this tokenizer; {FILL_FIX}")
