"""klppo: KL-regularised PPO from human or AI feedback, offline-first, on PyTorch."""

__version__ = "0.1.0"
