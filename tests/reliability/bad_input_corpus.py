"""The whole bad-input corpus: every case of ``cases_*.py``, by name."""

from cases_config_report import CASES as CONFIG_REPORT_CASES
from cases_ppo import CASES as PPO_CASES
from cases_sft_rm import CASES as SFT_RM_CASES

CORPUS = {**PPO_CASES, **SFT_RM_CASES, **CONFIG_REPORT_CASES}
SOURCES = (PPO_CASES, SFT_RM_CASES, CONFIG_REPORT_CASES)
