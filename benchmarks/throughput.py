"""Throughput of one PPO iteration: padded fixed micro-batches vs token-budget micro-batches + packing.

    python benchmarks/throughput.py            # the default workload (a few minutes on 2 CPU cores)
    python benchmarks/throughput.py --help     # model size, batch, lengths, budget, seed, repeats

Workload: a Qwen2-shaped model built from a config (random weights; actor, reference and a
critic with a value head), a batch of sequences with uniform prompt lengths and log-normal
response lengths, and one PPO iteration over it as ``ppo_trainer`` runs it: old and
reference log-probs, values, KL-shaped rewards and GAE, a critic update and an actor update.

Two paths over the same batch and the same initial weights, in one process, interleaved
(ABBA order) and repeated after one untimed warm-up run each:
- padded: fixed ``--micro-batch-size`` rows per micro-batch, each padded to its own longest
  prompt and response (klppo's default path, use_dynamic_bsz and use_remove_padding off);
- packed: micro-batches under a ``--max-token-len`` budget, balanced by Karmarkar-Karp, each
  run as one packed row with klppo's packed sdpa attention (use_dynamic_bsz and
  use_remove_padding on).
Tokens/s counts the batch's real tokens (prompt + response) over the iteration's wall time,
as ``perf/throughput`` does. The real-token fraction is real tokens / tokens the models were
run on, counted by a hook on every model forward. Model TFLOP/s uses ``model_flops``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import resource
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from klppo.algo import apply_kl_penalty, compute_gae_advantage_return
from klppo.models.forward import use_packed_attention
from klppo.monitoring.flops import model_flops
from klppo.monitoring.timer import PhaseTimer
from klppo.rewards.token_scores import scores_at_last_token
from klppo.rollout.batch import RolloutBatch
from klppo.data.batching import MicroBatching
from klppo.trainer.forwards import compute_log_prob, compute_values
from klppo.run.settings import ActorUpdateSettings, CriticUpdateSettings
from klppo.trainer.update import update_actor, update_critic

PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 4 x hidden size")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64, help="sequences in the PPO batch")
    p.add_argument("--mini-batch-size", type=int, default=32, help="sequences per optimiser step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch (padded path)")
    p.add_argument("--max-token-len", type=int, default=4096, help="token budget per micro-batch (packed path)")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--response-min", type=int, default=16)
    p.add_argument("--response-max", type=int, default=512)
    p.add_argument("--response-median", type=float, default=96.0, help="median of the log-normal response lengths")
    p.add_argument("--response-sigma", type=float, default=1.0, help="sigma of log(response length)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each path (after one warm-up each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads; 0 = torch's choice (one per core). On a machine busy with other "
                        "work, 1 keeps threads from waiting for each other at every op")
    return p.parse_args(argv)


# ---- workload ----


def model_config(args) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size or 4 * args.hidden_size,
        max_position_embeddings=args.prompt_max + args.response_max, tie_word_embeddings=True,
        num_labels=1, pad_token_id=0, use_cache=False,
    )


def build_models(config: Qwen2Config, seed: int):
    """Actor, reference (a copy) and critic (the same backbone, a value head), all fp32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        actor = Qwen2ForCausalLM(config)
        critic = Qwen2ForTokenClassification(config)
    critic.model.load_state_dict(actor.model.state_dict())
    return actor, copy.deepcopy(actor).requires_grad_(False), critic


def synthetic_lengths(args, g: torch.Generator) -> tuple[list[int], list[int]]:
    """Uniform prompt lengths; log-normal response lengths clipped to [response_min, response_max]."""
    prompts = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch_size,), generator=g)
    normal = torch.randn(args.batch_size, generator=g)
    responses = (math.log(args.response_median) + args.response_sigma * normal).exp().round()
    responses = responses.clamp(args.response_min, args.response_max)
    return prompts.tolist(), responses.long().tolist()


def synthetic_batch(args, vocab_size: int) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of random tokens, with random scores."""
    g = torch.Generator().manual_seed(args.seed)
    prompt_lens, response_lens = synthetic_lengths(args, g)
    rows, width_p, width_t = args.batch_size, max(prompt_lens), max(response_lens)
    cols_p, cols_t = torch.arange(width_p), torch.arange(width_t)
    prompt_mask = cols_p >= width_p - torch.tensor(prompt_lens)[:, None]  # (B, P)
    response_mask = cols_t < torch.tensor(response_lens)[:, None]  # (B, T)
    prompt_ids = torch.randint(1, vocab_size, (rows, width_p), generator=g) * prompt_mask
    response_ids = torch.randint(1, vocab_size, (rows, width_t), generator=g) * response_mask
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        group_index=torch.arange(rows), data_sources=["synthetic"] * rows, ground_truths=[None] * rows,
        extra_infos=[{}] * rows,
    )
    batch.token_level_scores = scores_at_last_token(torch.randn(rows, generator=g), response_mask)
    return batch


# ---- FLOPs ----


def iteration_flops(config: Qwen2Config, seq_lens: list[int], response_tokens: int) -> float:
    """Useful FLOPs of one PPO iteration: 2 no-grad LM forwards (old, ref) and the actor's
    training pass, whose LM head runs at the response tokens; the critic's value forward and
    training pass, whose 1-output head runs at every token."""
    lm = dict(head_positions=response_tokens)
    value = dict(head_outputs=1)
    return (2 * model_flops(config, seq_lens, training=False, **lm) + model_flops(config, seq_lens, training=True, **lm)
            + model_flops(config, seq_lens, training=False, **value)
            + model_flops(config, seq_lens, training=True, **value))


# ---- the two paths ----


@dataclasses.dataclass(frozen=True)
class PathSpec:
    name: str
    micro_batch_rows: int | None
    max_token_len: int | None
    packed: bool


class TokenCounter:
    """Counts the tokens every model forward runs on (padding included) and the real ones."""

    def __init__(self, models) -> None:
        self.computed = self.real = self.largest = 0
        self.handles = [m.register_forward_pre_hook(self._count, with_kwargs=True) for m in models]

    def _count(self, module, args, kwargs) -> None:
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        self.computed += ids.numel()
        self.real += int(mask.sum()) if mask is not None else ids.numel()
        self.largest = max(self.largest, ids.numel())


def ppo_iteration(models, batch: RolloutBatch, spec: PathSpec, args) -> PhaseTimer:
    """Steps 3-6 of ``ppo_trainer``: score, shape, advantages, critic and actor updates."""
    actor, ref, critic = models
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-5)
    micro = MicroBatching(rows=spec.micro_batch_rows, max_tokens=spec.max_token_len, packed=spec.packed)
    split = dict(mini_batch_rows=args.mini_batch_size, micro=micro, ppo_epochs=1, grad_clip=1.0)
    timer = PhaseTimer()
    with timer.phase("step"):
        with timer.phase("old_log_prob"):
            batch.old_log_prob = compute_log_prob(actor, batch, micro, temperature=1.0)
        with timer.phase("ref"):
            batch.ref_log_prob = compute_log_prob(ref, batch, micro, temperature=1.0)
        with timer.phase("values"):
            batch.values = compute_values(critic, batch, micro)
        rewards, _ = apply_kl_penalty(batch.token_level_scores, batch.old_log_prob, batch.ref_log_prob,
                                      batch.response_mask, kl_coef=0.001, kl_penalty="kl")
        batch.advantages, batch.returns = compute_gae_advantage_return(rewards, batch.values, batch.response_mask, 1.0, 1.0)
        with timer.phase("update_critic"):
            update_critic(critic, critic_opt, batch, CriticUpdateSettings(
                cliprange_value=0.5, loss_agg_mode="token-mean", **split))
        with timer.phase("update_actor"):
            update_actor(actor, actor_opt, batch, ActorUpdateSettings(
                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                entropy_coeff=0.001, use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
                temperature=1.0, **split))
    return timer


def run_path(spec: PathSpec, models, initial, batch: RolloutBatch, args) -> tuple[PhaseTimer, TokenCounter, RolloutBatch]:
    """One iteration from the initial weights on a fresh copy of the batch."""
    for model, state in zip(models, initial):
        model.load_state_dict(state)
    counter = TokenCounter(models)
    fresh = dataclasses.replace(batch)
    try:
        timer = ppo_iteration(models, fresh, spec, args)
    finally:
        for handle in counter.handles:
            handle.remove()
    return timer, counter, fresh


def describe(args, batch: RolloutBatch, n_params: int) -> None:
    prompts, responses = batch.prompt_mask.sum(-1).tolist(), batch.response_mask.sum(-1).tolist()
    print(f"model: Qwen2-shaped, {n_params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden_size}, "
          f"vocab {args.vocab_size}); torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{os.cpu_count()} cores")
    print(f"batch: {len(batch)} sequences, {sum(prompts) + sum(responses)} real tokens; prompts {min(prompts)}-"
          f"{max(prompts)}, responses {min(responses)}-{max(responses)} (median {statistics.median(responses):.0f}) "
          f"tokens; mini-batch {args.mini_batch_size}")
    print(f"padded: {args.micro_batch_size} rows per micro-batch; packed: {args.max_token_len} tokens per micro-batch")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")


def run_interleaved(specs, initial, batch: RolloutBatch, args):
    """Warm-up, then ``repeats`` timed runs of each path in ABBA order; per path: seconds, CPU seconds, phases."""
    results = {name: {"seconds": [], "cpu_seconds": [], "phases": []} for name in specs}
    outputs = {}
    for rep in range(args.repeats + 1):  # run 0 is the untimed warm-up
        for name in (["padded", "packed"] if rep % 2 == 0 else ["packed", "padded"]):
            spec, models = specs[name]
            cpu_start = time.process_time()
            timer, counter, outputs[name] = run_path(spec, models, initial, batch, args)
            cpu = time.process_time() - cpu_start
            results[name]["counter"] = counter
            if rep > 0:
                results[name]["seconds"].append(timer.seconds["step"])
                results[name]["cpu_seconds"].append(cpu)
                results[name]["phases"].append(timer.seconds)
            print(f"  run {rep}{' (warm-up)' if rep == 0 else ''} {name:>6}: {timer.seconds['step']:.2f} s "
                  f"({cpu:.2f} s CPU)")
    return results, outputs


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = model_config(args)
    padded_models = build_models(config, args.seed)
    initial = [copy.deepcopy(m.state_dict()) for m in padded_models]
    packed_models = tuple(copy.deepcopy(m) for m in padded_models)
    for model in packed_models:
        use_packed_attention(model)
    batch = synthetic_batch(args, config.vocab_size)
    specs = {
        "padded": (PathSpec("padded", args.micro_batch_size, None, False), padded_models),
        "packed": (PathSpec("packed", None, args.max_token_len, True), packed_models),
    }
    describe(args, batch, sum(p.numel() for p in padded_models[0].parameters()))
    results, outputs = run_interleaved(specs, initial, batch, args)
    return report(results, outputs, config, batch.attention_mask.sum(-1).tolist(), int(batch.response_mask.sum()))


def report(results, outputs, config, seq_lens, response_tokens: int) -> dict:
    """Median seconds, tokens/s, TFLOP/s, real-token fraction and phases of each path; their ratio."""
    real_tokens, flops = sum(seq_lens), iteration_flops(config, seq_lens, response_tokens)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\n{'path':>6} {'median s':>9} {'CPU s':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'real/computed':>14} "
          f"{'largest fwd':>12}   " + " ".join(f"{p:>13}" for p in PHASES))
    summary = {}
    for name, r in results.items():
        seconds, counter = statistics.median(r["seconds"]), r["counter"]
        phases = {p: statistics.median(ph[p] for ph in r["phases"]) for p in PHASES}
        summary[name] = dict(seconds=seconds, tokens_per_s=real_tokens / seconds, real_fraction=counter.real / counter.computed)
        print(f"{name:>6} {seconds:>9.2f} {statistics.median(r['cpu_seconds']):>7.2f} {real_tokens / seconds:>9.0f} "
              f"{flops / seconds / 1e12:>8.3f} {counter.real / counter.computed:>14.3f} {counter.largest:>12}   "
              + " ".join(f"{phases[p]:>13.2f}" for p in PHASES))
    ratio = summary["packed"]["tokens_per_s"] / summary["padded"]["tokens_per_s"]
    mask = outputs["padded"].response_mask
    drift = max((outputs["packed"].old_log_prob - outputs["padded"].old_log_prob)[mask].abs().max().item(),
                (outputs["packed"].values - outputs["padded"].values)[mask].abs().max().item())
    print(f"\npacked / padded tokens/s: {ratio:.2f}x; real-token fraction packed {summary['packed']['real_fraction']:.3f}, "
          f"padded {summary['padded']['real_fraction']:.3f}")
    print(f"max |difference| of old log-probs and values between the paths: {drift:.2e}")
    print(f"peak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")
    summary.update(ratio=ratio, drift=drift)
    return summary


if __name__ == "__main__":
    main()
