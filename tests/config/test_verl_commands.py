"""verl's own command lines validate in klppo (data/verl_commands.txt, written from verl's example
scripts and docs): each passes `klppo validate-config`, vLLM rollouts stay vLLM (SGLang ones
resolve to hf with one warning), and one summary warning lists exactly the keys that have no effect."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from klppo.cli import main

COMMANDS = Path(__file__).parent / "data" / "verl_commands.txt"
_LISTED = re.compile(r"(?:^  - |, )([A-Za-z_][\w.\-]*)=")


@dataclass
class Command:
    name: str
    expect: str  # "ok", or the text the error must contain
    no_effect: set[str]
    args: list[str]


def read_commands() -> list[Command]:
    commands = []
    for block in COMMANDS.read_text().split("\n## ")[1:]:
        lines = block.splitlines()
        name = lines[0].split(":", 1)[0]
        expect = next(line for line in lines if line.startswith("# expect:")).split(":", 1)[1].strip()
        no_effect = next(line for line in lines if line.startswith("# no effect:")).split(":", 1)[1].split()
        shell = " ".join(line.rstrip("\\") for line in lines[1:] if not line.startswith("#"))
        words = shlex.split(shell)
        args = words[words.index("verl.trainer.main_ppo") + 1:]
        commands.append(Command(name, "ok" if expect == "ok" else expect.removeprefix("error ").strip(),
                                set(no_effect), args))
    return commands


CORPUS = read_commands()


def with_real_paths(args: list[str], root: Path) -> list[str]:
    """@DATA@ / @MODELS@ pointed at folders of real files (empty ones: validation reads no file)."""
    data, models = root / "data", root / "models"
    out = [a.replace("@DATA@", str(data)).replace("@MODELS@", str(models)) for a in args]
    for arg in out:
        for path in re.findall(rf"{re.escape(str(root))}[^'\",\]\s]*", arg):
            target = Path(path)
            if target.suffix == ".parquet":
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
            else:
                target.mkdir(parents=True, exist_ok=True)
    return out


def listed_keys(stderr: str) -> list[str]:
    """The keys named by the summary warning's lines."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if "no effect in klppo (accepted" in line), None)
    if start is None:
        return []
    keys = []
    for line in lines[start + 1:]:
        if not line.startswith("  - "):
            break
        keys += _LISTED.findall(line.split(": no effect in klppo")[0])
    return keys


@pytest.fixture
def any_logger_installed(monkeypatch):
    """verl's scripts log to wandb; whether that package is installed is the machine's business."""
    import klppo.monitoring.backends as backends

    monkeypatch.setattr(backends, "missing_package", lambda name: None)


def test_the_corpus_has_twenty_commands_of_every_estimator():
    assert len(CORPUS) >= 20
    estimators = {a.split("=")[1] for c in CORPUS for a in c.args if a.startswith("algorithm.adv_estimator=")}
    assert {"gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "gpg"} <= estimators


@pytest.mark.parametrize("command", CORPUS, ids=lambda c: c.name)
def test_verl_command_line_validates_with_one_warning_naming_its_keys_without_effect(
    command, tmp_path, capsys, any_logger_installed
):
    code = main(["validate-config", *with_real_paths(command.args, tmp_path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if command.expect != "ok":
        assert code == 2 and command.expect in err, err
        return
    assert code == 0, err
    assert sorted(listed_keys(err)) == sorted(command.no_effect), err
    summaries = [line for line in err.splitlines() if "no effect in klppo (accepted" in line]
    assert len(summaries) == (1 if command.no_effect else 0)
    asked = [a.split("=", 1)[1] for a in command.args if a.startswith("actor_rollout_ref.rollout.name=")]
    fallbacks = [line for line in err.splitlines() if "generating with 'hf'" in line]
    assert len(fallbacks) == (1 if asked and asked[-1] in ("sglang", "trtllm") else 0), err
    resolved = yaml.safe_load(out)
    expected = {"vllm": "vllm", "sglang": "hf", "trtllm": "hf", "hf": "hf"}.get(asked[-1] if asked else "", "offline")
    assert resolved["actor_rollout_ref"]["rollout"]["name"] == expected


def test_verl_command_line_through_the_real_executable_keeps_yaml_on_stdout(tmp_path):
    (quickstart,) = [c for c in CORPUS if c.name == "quickstart_ppo_gsm8k"]
    result = subprocess.run([sys.executable, "-m", "klppo.cli", "validate-config",
                             *with_real_paths(quickstart.args, tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)  # warnings went to stderr
    rollout = resolved["actor_rollout_ref"]["rollout"]
    assert (rollout["name"], rollout["log_prob_micro_batch_size_per_gpu"]) == ("vllm", 8)
    assert (rollout["tensor_model_parallel_size"], rollout["gpu_memory_utilization"]) == (1, 0.4)  # they act
    assert "Traceback" not in result.stderr and "warning:" not in result.stderr  # every key it sets acts


def test_what_the_corpus_sets_reaches_the_typed_config(tmp_path, capsys, any_logger_installed):
    """Spot checks that accepted keys act: global micro-batches, reward-model lengths, verl 0.9.1's spellings."""
    by_name = {c.name: c for c in CORPUS}
    resolved = {}
    for name in ("docs_ppo_reference_example", "ppo_qwen2-7b_rm", "verl091_reward_section", "ppo_qwen2-7b_rm_legacy",
                 "gspo_3b_math", "gptoss_20b_reasoning_effort"):
        assert main(["validate-config", *with_real_paths(by_name[name].args, tmp_path)]) == 0
        resolved[name] = yaml.safe_load(capsys.readouterr().out)
    assert resolved["gspo_3b_math"]["trainer"]["log_val_generations"] == 2  # validation samples shown
    assert resolved["gptoss_20b_reasoning_effort"]["data"]["apply_chat_template_kwargs"] == {"reasoning_effort": "medium"}
    docs = resolved["docs_ppo_reference_example"]
    assert docs["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == 2  # 2 over 1 device
    assert docs["critic"]["ppo_micro_batch_size_per_gpu"] == 2
    assert resolved["ppo_qwen2-7b_rm"]["reward_model"]["rollout"] == {"prompt_length": 2048, "response_length": 1024}
    new = resolved["verl091_reward_section"]
    assert new["reward_model"]["enable"] is True and new["reward_model"]["model"]["path"].endswith("FsfairX-LLaMA3-RM-v0.1")
    assert new["reward_model"]["rollout"]["prompt_length"] == 1024
    assert new["actor_rollout_ref"]["actor"]["grad_clip"] == 0.5
    assert new["actor_rollout_ref"]["actor"]["optim"]["warmup_style"] == "cosine"
    assert new["critic"]["model"]["fsdp_config"]["param_offload"] is True
    legacy = resolved["ppo_qwen2-7b_rm_legacy"]["reward_model"]
    assert legacy["model"]["use_remove_padding"] is True and legacy["model"]["fsdp_config"]["param_offload"] is True
    assert legacy["micro_batch_size_per_gpu"] == 32
