"""The typed config tree (verl's key names) and its loader: YAML + overrides -> validated config."""

from klppo.config.hydra import command_line_config
from klppo.config.parse import config_to_dict, format_config, load_ppo_config, load_rm_config, load_sft_config
from klppo.config.schema import PPOConfig
from klppo.config.supervised import RMConfig, SFTConfig

__all__ = [
    "PPOConfig",
    "RMConfig",
    "SFTConfig",
    "command_line_config",
    "config_to_dict",
    "format_config",
    "load_ppo_config",
    "load_rm_config",
    "load_sft_config",
]
