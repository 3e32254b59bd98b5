"""The ``klppo`` command: ``ppo``, ``sft``, ``rm``, ``demo``, ``report``, ``plan``, ``score-logprobs``, ``export``
and ``validate-config``."""

from __future__ import annotations

import argparse
import sys

from klppo.cli_support import add_hydra_config_args, run_cli

# Sub-commands that own their argument parsing (so `klppo ppo --config x.yaml a.b=1` reaches
# main_ppo exactly as `python -m klppo.commands.main_ppo --config x.yaml a.b=1` would).
DELEGATED = {
    "ppo": ("klppo.commands.main_ppo", "train with KL-regularised PPO (--config x.yaml key=value ...)"),
    "sft": ("klppo.commands.main_sft", "supervised warm start (--config x.yaml key=value ...)"),
    "rm": ("klppo.commands.main_rm", "train a reward model from ranked responses (--config x.yaml key=value ...)"),
    "demo": ("klppo.commands.demo", "build a task and a tiny model, warm-start it, train it with PPO"),
    "report": ("klppo.monitoring.report", "plots, guard events and a diagnosis of a run (RUN_DIR [--format html])"),
    "plan": ("klppo.plan.command", "batches, memory per rank and phase, and time of a config, before it runs "
             "(CONFIG [key=value ...] [--gpus-per-node N --device-memory 80GiB ...])"),
    "score-logprobs": ("klppo.commands.score_logprobs", "fill rollout_log_probs of recorded responses with a model "
                       "(--model DIR --input IN --output OUT)"),
    "export": ("klppo.commands.export", "a checkpoint's model as a Hugging Face folder "
               "(RUN_DIR or global_step_N, OUT [key=value ...] [--model critic])"),
}


def _validate_config(argv: list[str]) -> int:
    from klppo.config import command_line_config, format_config, load_ppo_config, load_sft_config

    parser = argparse.ArgumentParser(prog="klppo validate-config", description="Print the resolved config (YAML, on "
                                     "stdout) and its warnings (stderr), or its errors.")
    parser.add_argument("config", nargs="?", help="YAML file; may be left out when only overrides are given")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides (verl's command-line form)")
    parser.add_argument("--sft", action="store_true", help="validate against the SFT schema")
    add_hydra_config_args(parser)
    args = parser.parse_intermixed_args(argv)  # options anywhere among the config and overrides
    if args.config is not None and "=" in args.config:  # a verl-style command line: overrides only
        args.overrides, args.config = [args.config, *args.overrides], None
    load = load_sft_config if args.sft else load_ppo_config

    def show() -> None:
        notes: list[str] = []
        text = format_config(load(*command_line_config(args), notes=notes))
        for line in notes:  # warnings first, on stderr, so stdout stays the YAML
            print(line, file=sys.stderr)
        print(text, end="")

    return run_cli(show)


def _usage() -> str:
    lines = ["usage: klppo {" + ",".join([*DELEGATED, "validate-config"]) + "} ...", "", "commands:"]
    lines += [f"  {name:16s}{help_text}" for name, (_, help_text) in DELEGATED.items()]
    lines.append(f"  {'validate-config':16s}print the resolved config of a YAML file, or its errors")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in DELEGATED:
        import importlib

        return importlib.import_module(DELEGATED[command][0]).main(rest)
    if command == "validate-config":
        return _validate_config(rest)
    print(f"klppo: unknown command '{command}'\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
