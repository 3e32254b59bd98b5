"""Every YAML file under examples/ is a valid config (SFT files by name, the rest PPO)."""

from pathlib import Path

import pytest

from klppo.config import load_ppo_config, load_sft_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_example_config_validates(path):
    load = load_sft_config if "sft" in path.stem else load_ppo_config
    load(str(path))
