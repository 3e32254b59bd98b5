"""Offline rollout correction end to end: score-logprobs fills the column, PPO corrects with it."""

import hashlib
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.cli import main
from klppo.data.arithmetic import arithmetic_corpus
from klppo.data.rl_dataset import load_rl_dataset
from klppo.errors import UserError
from klppo.models.forward import response_logprobs
from klppo.models.tiny import build_tiny_model_folder
from klppo.run import build
from klppo.run.build import ROLLOUT_CORRECTION_NEED
from klppo.commands.main_ppo import run_ppo
from tests.conftest import THINKING_TEMPLATE, TINY

CORRECTED = {"algorithm.rollout_correction.rollout_is": "token",
             "algorithm.rollout_correction.rollout_is_threshold": 1.2,
             "algorithm.rollout_correction.rollout_rs": "token_k1",
             "algorithm.rollout_correction.rollout_rs_threshold": "0.8_1.25"}


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture(scope="module")
def behaviour_model_dir(tmp_path_factory):
    """The policy that 'wrote' the responses: the tiny model's shape and tokenizer, other weights."""
    return build_tiny_model_folder(tmp_path_factory.mktemp("behaviour"), arithmetic_corpus(200, 0), seed=7, **TINY)


@pytest.fixture(scope="module")
def scored_file(behaviour_model_dir, task_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("scored") / "offline_scored.parquet"
    assert main(["score-logprobs", "--model", str(behaviour_model_dir), "--input", str(task_dir / "offline.parquet"),
                 "--output", str(out), "--batch-size", "5", "--device", "cpu"]) == 0
    return out


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_score_logprobs_writes_the_models_log_probs_that_the_reader_accepts(scored_file, behaviour_model_dir,
                                                                             task_dir):
    tokenizer = AutoTokenizer.from_pretrained(behaviour_model_dir)
    records = load_rl_dataset(scored_file, tokenizer, max_prompt_length=256, require_responses=True,
                              require_rollout_log_probs=ROLLOUT_CORRECTION_NEED, log=quiet)
    assert pq.read_table(task_dir / "offline.parquet").num_rows == len(records)
    _check_first_response_scored(records[0], behaviour_model_dir, tokenizer)


def _check_first_response_scored(record, model_dir, tokenizer) -> None:
    """The first response's column is its log-probs scored in a batch of its own: prompt, then response + EOS."""
    response = tokenizer(record.responses[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([record.prompt_ids + response])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        expected, _ = response_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), len(response))
    torch.testing.assert_close(torch.tensor(record.rollout_log_probs[0]), expected[0], rtol=1e-5, atol=1e-5)


def test_score_logprobs_renders_prompts_with_the_chat_template_kwargs_training_uses(behaviour_model_dir, task_dir,
                                                                                     scored_file, tmp_path, capsys):
    model = shutil.copytree(behaviour_model_dir, tmp_path / "thinking_model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = THINKING_TEMPLATE  # an empty thought (2 special tokens) with enable_thinking=false
    tokenizer.save_pretrained(model)
    out = tmp_path / "scored.parquet"
    assert main(["score-logprobs", "--model", str(model), "--input", str(task_dir / "offline.parquet"), "--output",
                 str(out), "--chat-template-kwargs", "{enable_thinking: false}", "--device", "cpu"]) == 0
    records = load_rl_dataset(out, tokenizer, max_prompt_length=256, require_responses=True,
                              require_rollout_log_probs=ROLLOUT_CORRECTION_NEED, log=quiet,
                              template_kwargs={"enable_thinking": False})
    _check_first_response_scored(records[0], model, tokenizer)
    without = pq.read_table(scored_file).column("rollout_log_probs")[0].as_py()[0]  # same weights, no thought
    assert records[0].rollout_log_probs[0] != pytest.approx(without, abs=1e-4)
    capsys.readouterr()
    code = main(["score-logprobs", "--model", str(model), "--input", str(task_dir / "offline.parquet"), "--output",
                 str(tmp_path / "other.parquet"), "--chat-template-kwargs", "{tokenize: true}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--chat-template-kwargs.tokenize: klppo sets this argument" in err[0], err


@pytest.mark.parametrize("case", ["output is input", "output exists", "no input", "no output folder"])
def test_score_logprobs_refuses_bad_paths_in_one_line_and_never_writes_its_input(case, behaviour_model_dir,
                                                                                  task_dir, tmp_path, capsys):
    source = task_dir / "offline.parquet"
    before = _digest(source)
    existing = tmp_path / "existing.parquet"
    existing.write_bytes(b"keep me")
    paths = {"output is input": (source, source, "is the input file"),
             "output exists": (source, existing, "exists; choose another path, or pass --force"),
             "no input": (tmp_path / "none.parquet", tmp_path / "out.parquet", "is not a file"),
             "no output folder": (source, tmp_path / "missing" / "out.parquet", "does not exist; create it")}
    src, dst, problem = paths[case]
    code = main(["score-logprobs", "--model", str(behaviour_model_dir), "--input", str(src), "--output", str(dst)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and problem in err[0], err
    assert _digest(source) == before and existing.read_bytes() == b"keep me"


def test_offline_ppo_with_token_is_and_rejection_logs_the_rollout_corr_metrics(ppo_overrides, scored_file):
    records = run_ppo(None, ppo_overrides(**{"data.train_files": scored_file, **CORRECTED}), print_fn=quiet)
    for record in records:
        for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size",
                    "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl", "rollout_corr/chi2_token"):
            assert key in record, key
    # another model wrote the responses: some ratios pass the bounds (random-init models differ mildly)
    assert records[0]["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    assert 0 < records[0]["rollout_corr/rollout_rs_masked_fraction"] < 0.5
    assert abs(records[0]["rollout_corr/kl"]) > 0.01


def test_without_the_correction_the_column_only_adds_diagnostics(ppo_overrides, scored_file, task_dir, tmp_path):
    """... and the offline KL estimate, importance-weighted with the column, sampled without it."""
    plain = run_ppo(None, ppo_overrides(tmp_path / "plain"), print_fn=quiet)
    with_column = run_ppo(None, ppo_overrides(tmp_path / "column", **{"data.train_files": scored_file}),
                          print_fn=quiet)
    for a, b in zip(plain, with_column):
        extra = {k for k in b if k.startswith("rollout_corr/")}
        assert extra and "rollout_corr/rollout_is_mean" not in extra
        estimate = ("actor/kl_to_ref", "actor/kl_to_ref_sampled")
        same = {k: v for k, v in a.items() if not k.startswith(("timing_s/", "perf/")) and k not in estimate}
        assert same == {k: b[k] for k in same}


def test_bypass_mode_takes_mu_as_pi_old_and_skips_that_forward(ppo_overrides, scored_file):
    records = run_ppo(None, ppo_overrides(**{"data.train_files": scored_file,
                                             "algorithm.rollout_correction.bypass_mode": "true",
                                             "algorithm.rollout_correction.loss_type": "reinforce",
                                             "algorithm.rollout_correction.rollout_is": "sequence"}), print_fn=quiet)
    assert "timing_s/old_log_prob" not in records[-1] and "timing_s/ref" in records[-1]
    assert "rollout_corr/rollout_is_seq_mean" in records[-1] and records[-1]["actor/pg_clipfrac"] == 0.0


def test_the_correction_on_data_without_the_column_names_the_row_and_the_command(ppo_overrides):
    with pytest.raises(UserError, match=r"row 0, column 'rollout_log_probs': .*klppo score-logprobs"):
        run_ppo(None, ppo_overrides(**CORRECTED), print_fn=quiet)


def test_the_importance_weighted_kl_on_data_without_the_column_is_refused_before_any_model_loads(ppo_overrides,
                                                                                                monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(build, "load_model", no_model)
    with pytest.raises(UserError, match=r"offline.parquet row 0, column 'rollout_log_probs': no behaviour log-probs "
                                        r".*offline_kl=importance_weighted needs for every row.*klppo score-logprobs"):
        run_ppo(None, ppo_overrides(**{"algorithm.kl_ctrl.offline_kl": "importance_weighted"}), print_fn=quiet)


def test_offline_kl_is_importance_weighted_when_the_data_has_behaviour_log_probs(scored_file, ppo_overrides,
                                                                                tmp_path):
    """The recorded responses come from another policy: their log-ratio to the reference is logged as
    the recorded k1, and the KL the guards read is the importance-weighted one."""
    record = run_ppo(None, ppo_overrides(**{"data.train_files": scored_file, "trainer.total_training_steps": 2}),
                     print_fn=quiet)[-1]
    assert record["actor/kl_to_ref"] == record["actor/kl_to_ref_importance_weighted"]
    assert 1.0 <= record["actor/kl_is_effective_sample_size"] <= 16.0
    assert "actor/kl_to_ref_recorded" in record and "actor/kl_to_ref_sampled" not in record
    sampled = run_ppo(None, ppo_overrides(tmp_path / "sampled", **{
                                          "data.train_files": scored_file, "trainer.total_training_steps": 2,
                                          "algorithm.kl_ctrl.offline_kl": "sampled", "algorithm.kl_ctrl.probe_every": 1}),
                     print_fn=quiet)[-1]
    assert sampled["actor/kl_to_ref"] == sampled["actor/kl_to_ref_sampled"]


def test_the_optimal_token_baseline_weighs_tokens_by_the_corrections_squared_weights(ppo_overrides, scored_file,
                                                                                    monkeypatch):
    import klppo.algo.advantages as advantages

    given, otb = [], advantages.compute_optimal_token_baseline_advantage
    monkeypatch.setattr(advantages, "compute_optimal_token_baseline_advantage",
                        lambda *args, **kwargs: given.append(args[5]) or otb(*args, **kwargs))
    records = run_ppo(None, ppo_overrides(**{"data.train_files": scored_file, **CORRECTED,
                                             "algorithm.adv_estimator": "optimal_token_baseline",
                                             "algorithm.use_kl_in_reward": "false"}), print_fn=quiet)
    # the weights the update applies (truncated at 1.2), over the whole step's batch
    assert len(given) == 2 and all(w is not None and 0 < w.max() <= 1.2 for w in given)
    assert given[0].max() == pytest.approx(1.2)
    assert all("variance_proxy/proxy2_total_power" in r and "rollout_corr/rollout_is_mean" in r for r in records)
