"""Every YAML file under examples/ is a valid config (SFT files by name, the rest PPO), but the tool and
interaction files of multi-turn examples (a top-level ``tools`` or ``interaction`` list), which
``klppo.rollout.tools`` loads (tests/examples/test_gsm8k_tool_example.py)."""

from pathlib import Path

import pytest
import yaml

from klppo.config import load_ppo_config, load_sft_config


def is_example_config(path: Path) -> bool:
    """Whether a YAML file of examples/ is a run's config (not a multi-turn tool or interaction file)."""
    return not {"tools", "interaction"} & set(yaml.safe_load(path.read_text()) or {})


EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").rglob("*.yaml") if is_example_config(p))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_example_config_validates(path):
    load = load_sft_config if "sft" in path.stem else load_ppo_config
    load(str(path))
