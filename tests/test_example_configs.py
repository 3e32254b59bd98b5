"""Every YAML file under examples/ is a valid config (SFT files by name, the rest PPO), but the tool and
interaction files of multi-turn examples (a top-level ``tools`` or ``interaction`` list), which
``klppo.rollout.tools`` loads (tests/examples/test_gsm8k_tool_example.py)."""

from pathlib import Path

import pytest
import yaml

from klppo.config import load_ppo_config, load_sft_config


def _is_config(path: Path) -> bool:
    return not {"tools", "interaction"} & set(yaml.safe_load(path.read_text()) or {})


EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").rglob("*.yaml") if _is_config(p))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_example_config_validates(path):
    load = load_sft_config if "sft" in path.stem else load_ppo_config
    load(str(path))
