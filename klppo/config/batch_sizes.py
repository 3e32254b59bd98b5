"""The batch-size rules of a PPO config on a given number of ranks: their one home.

verl's units: ``data.train_batch_size`` and ``ppo_mini_batch_size`` count prompts, and each
prompt brings ``rollout.n`` samples; each of W ranks trains on ``ppo_mini_batch_size * n // W``
samples of every mini-batch (verl normalises the mini-batch so in its FSDP workers, flooring
it where it does not split evenly), split into micro-batches of ``ppo_micro_batch_size_per_gpu``
samples or, with ``use_dynamic_bsz``, into as few as fit ``ppo_max_token_len_per_gpu`` tokens
(the micro size is then ignored). A rank's share of the step that its mini-batches do not
divide ends in a smaller mini-batch, as verl's ``split`` leaves it; both uneven cases train as
verl trains them, with a warning (``mini_batch_notes``).

A combination that cannot train is refused here with its fix: a rank's share below one sample,
a mini-batch larger than the step (verl asserts both), a micro-batch larger than the share or
not dividing it (verl asserts that; left alone a larger micro-batch is where verl's users get
zero accumulation steps and a NaN gradient norm), a token budget below one sequence. Config
validation asks with ``trainer.n_gpus_per_node x
trainer.nnodes`` ranks (the world ``join_world`` later insists on), ``compile_ppo`` with the
world it runs in, ``klppo plan`` with the world it is asked about. Each rule returns
``(keys, message)`` pairs, as ``engine_problems`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from klppo.config.rollout_correction import rollout_correction_active
from klppo.config.schema import FSDPConfig, PPOConfig

ROLLOUT = "actor_rollout_ref.rollout"
Found = list[tuple[tuple[str, ...], str]]


@dataclass(frozen=True)
class UpdateSizes:
    """One trained model's update sizes as the config gives them (verl's units)."""

    prefix: str  # actor_rollout_ref.actor | critic
    mini_batch_size: int  # prompts per mini-batch (x rollout.n samples)
    micro_batch_size_per_gpu: Optional[int]  # samples per micro-batch on a rank; None = the whole share
    use_dynamic_bsz: bool  # micro-batches by a token budget; the micro size is ignored
    max_token_len_per_gpu: int  # the token budget of one micro-batch
    ppo_epochs: int
    own_mini: bool = True  # False: the critic's copy of the actor's mini-batch size (reported there)

    @property
    def mini_key(self) -> str:
        return f"{self.prefix}.ppo_mini_batch_size"

    @property
    def micro_key(self) -> str:
        return f"{self.prefix}.ppo_micro_batch_size_per_gpu"

    @property
    def budget_key(self) -> str:
        return f"{self.prefix}.ppo_max_token_len_per_gpu"


def uses_critic(cfg: PPOConfig) -> bool:
    """GAE needs a value model; the group and REINFORCE estimators train none."""
    return cfg.algorithm.adv_estimator == "gae"


def uses_reference(cfg: PPOConfig) -> bool:
    """A KL term (in the reward or in the actor's loss) needs the reference's log-probs."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss


def measures_sum_pi_squared(cfg: PPOConfig) -> bool:
    """Whether pi_old's forward measures each token's sum of squared probabilities: the optimal token
    baseline reads it, and ``actor.calculate_sum_pi_squared`` asks for it (for the variance proxies)."""
    return (cfg.algorithm.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline")
            or cfg.actor_rollout_ref.actor.calculate_sum_pi_squared)


def picks_cov_tokens(cfg: PPOConfig) -> bool:
    """Whether the policy loss picks tokens by their covariance over each mini-batch (clip_cov, kl_cov):
    a no-grad forward per mini-batch, before its micro-batches, at the weights they train."""
    return cfg.actor_rollout_ref.actor.policy_loss.loss_mode in ("clip_cov", "kl_cov")


def update_gives_old_log_prob(cfg: PPOConfig, world: int) -> bool:
    """Whether the actor's update gives pi_old's log-probs itself, so that the scoring phase runs
    no forward for them (no ``old_log_prob`` phase): either ``update_forwards_first`` or an
    on-policy update (``on_policy_update``)."""
    return update_forwards_first(cfg, world) or on_policy_update(cfg)


def _one_optimizer_step(cfg: PPOConfig) -> bool:
    """One epoch over one mini-batch holding the whole step, for every trained model."""
    return all(role.ppo_epochs == 1 and role.mini_batch_size >= cfg.data.train_batch_size
               for role in update_sizes(cfg))


def on_policy_update(cfg: PPOConfig) -> bool:
    """Whether the actor's update is its own pi_old and nothing before it reads pi_old.

    One epoch over one mini-batch holding the whole step is one optimiser step, and its forward
    runs on the weights that sampled: the update takes old = log_prob.detach() (ratio exactly 1),
    as verl's dp_actor does then ("on_policy") and TRL's GRPOTrainer with one iteration. klppo
    then skips the separate forward where nothing before the update reads pi_old: the actor
    sampled the responses with HF generate (vLLM's and offline data's behaviour log-probs are
    compared with pi_old, and may correct the update), the KL is not in the reward, pi_old's
    sum of squared probabilities is not measured (``measures_sum_pi_squared``: the optimal token
    baseline reads it), the loss does not pick tokens by covariance (``picks_cov_tokens``: its own
    no-grad forward gives it pi_old's log-probs anyway), and the actor trains from the first step
    (no critic warm-up). The KL the guard checks before the
    update is measured by the update's forward, before its optimiser step. Any number of
    micro-batches. Where ``update_forwards_first`` holds too, it is used instead.
    """
    arf, algo = cfg.actor_rollout_ref, cfg.algorithm
    one_step = arf.actor.ppo_epochs == 1 and arf.actor.ppo_mini_batch_size >= cfg.data.train_batch_size
    return (one_step and arf.rollout.name == "hf" and not algo.use_kl_in_reward
            and not (uses_critic(cfg) and cfg.trainer.critic_warmup > 0) and not measures_sum_pi_squared(cfg)
            and not picks_cov_tokens(cfg))


def longest_sequence(cfg: PPOConfig) -> int:
    """The most tokens a sequence of the run may hold: the longest prompt and the longest response."""
    return cfg.data.max_prompt_length + (cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length)


def one_micro_batch(role: UpdateSizes, rows: int, longest: int) -> bool:
    """Whether ``rows`` samples of up to ``longest`` tokens are always one micro-batch of ``role``'s update."""
    if role.use_dynamic_bsz:
        return rows * longest <= role.max_token_len_per_gpu
    return role.micro_batch_size_per_gpu is None or role.micro_batch_size_per_gpu >= rows


def update_forwards_first(cfg: PPOConfig, world: int) -> bool:
    """Whether the updates' own forwards run before the step is scored and give it pi_old's
    log-probs and the critic's values, so that the scoring phase runs no forward for either.

    Where every trained model makes one optimiser step over one micro-batch per rank (one epoch,
    one mini-batch holding the step, a rank's samples within one micro-batch however long they
    are, decided from the maximum lengths), the forward its update runs anyway is the forward at
    the weights that sampled: its outputs, detached, are pi_old's log-probs and the values, and
    with their graphs kept they are the update's. The step's KL-shaped rewards and advantages
    are computed between those forwards and the losses, with everything else as in any step
    (the guard still acts before any weight moves). TRL's PPOTrainer takes pi_old from
    generation and verl recomputes it; this costs neither forward, only the memory of the
    actor's saved activations held during the critic's update (``klppo plan`` counts it).

    Used where something before the update reads pi_old or the values (the KL in the reward, a
    critic; otherwise ``on_policy_update`` needs no such hold), the responses' log-probs are not
    compared with a behaviour policy's (HF generate, or offline data without rollout correction),
    the actor trains from the first step, and neither model's parameters or optimiser state are
    offloaded between phases (the graphs would hold tensors of the device the model left). PF-PPO
    trains on rows drawn after the advantages, which the forwards run before could not know; the
    sum of squared probabilities (``measures_sum_pi_squared``) comes from pi_old's own forward, and
    Clip-Cov and KL-Cov run their own forward over each mini-batch first (``picks_cov_tokens``).
    """
    arf, algo, critic = cfg.actor_rollout_ref, cfg.algorithm, uses_critic(cfg)
    if world < 1 or not (algo.use_kl_in_reward or critic) or not _one_optimizer_step(cfg):
        return False
    if measures_sum_pi_squared(cfg) or picks_cov_tokens(cfg):
        return False
    if algo.use_pf_ppo and algo.adv_estimator == "gae":
        return False
    rows, longest = cfg.data.train_batch_size * arf.rollout.n // world, longest_sequence(cfg)
    offloaded = [arf.actor.fsdp_config] + ([cfg.critic.model.fsdp_config] if critic else [])
    return (all(one_micro_batch(role, rows, longest) for role in update_sizes(cfg))
            and (arf.rollout.name == "hf" or (arf.rollout.name == "offline" and not rollout_correction_active(cfg)))
            and not (critic and cfg.trainer.critic_warmup > 0)
            and not any(f.param_offload or f.optimizer_offload for f in offloaded))


def world_size(cfg: PPOConfig) -> int:
    """The ranks a run of ``cfg`` has (``join_world`` refuses any other world)."""
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


def fsdp_sections(cfg: PPOConfig) -> dict[str, FSDPConfig]:
    """Every model's ``fsdp_config`` by key: one process gets a process group of one when any asks for
    something only FSDP2 does (``join_world``), and then loads as ranks do."""
    arf = cfg.actor_rollout_ref
    sections = {"actor_rollout_ref.actor.fsdp_config": arf.actor.fsdp_config,
                "actor_rollout_ref.ref.fsdp_config": arf.ref.fsdp_config,
                "critic.model.fsdp_config": cfg.critic.model.fsdp_config}
    # verl scripts set the reward model's options even when it is off; a gold reward model uses them too.
    if cfg.reward_model.enable or cfg.trainer.gold_reward.model_path:
        sections["reward_model.model.fsdp_config"] = cfg.reward_model.model.fsdp_config
    return sections


def fsdp_size_problems(cfg: PPOConfig, world: int) -> Found:
    """Each model's ``fsdp_size``: -1, or a number of ranks per shard group. One at least the world
    shards over every rank, as verl's ``create_device_mesh`` does (an example script's 32 on the 8
    GPUs at hand); a smaller one must divide the world, since the groups replicate each other."""
    out: Found = []
    for prefix, fsdp in fsdp_sections(cfg).items():
        size, key = fsdp.fsdp_size, f"{prefix}.fsdp_size"
        if size != -1 and size < 1:
            out.append(((key,), f"{key} = {size}: use -1 (shard over every rank) or a number of ranks that divides "
                                "the world"))
        elif 1 <= size < world and world % size:
            out.append(((key, "trainer.n_gpus_per_node", "trainer.nnodes"),
                        f"{key} = {size} does not divide the {_ranks(world)} (trainer.n_gpus_per_node x "
                        f"trainer.nnodes): shard groups of {size} cannot cover them; use a divisor such as "
                        f"{divisor_below(world, size)}, or -1 to shard over every rank"))
    return out


def launch_mismatch(n_gpus_per_node: int, nnodes: int, launched: int) -> Optional[str]:
    """Why a run launched as ``launched`` processes does not match the world its config names, with the
    launch command that matches and the keys that match the launch; None when they agree.

    Asked before the batch-size rules: those are computed for the config's world, and a run
    started as one process with ``n_gpus_per_node: 4`` would otherwise be refused for a rank's
    share of 4 ranks without a word that it has one process.
    """
    if n_gpus_per_node * nnodes == launched or n_gpus_per_node < 1 or nnodes < 1:
        return None
    nodes = f"--nnodes {nnodes} " if nnodes > 1 else ""
    fit = (f"trainer.n_gpus_per_node={launched // nnodes}" if launched % nnodes == 0
           else f"trainer.nnodes=1 trainer.n_gpus_per_node={launched}")
    return (f"trainer.n_gpus_per_node x trainer.nnodes = {n_gpus_per_node} x {nnodes} = {n_gpus_per_node * nnodes} "
            f"ranks, but this run was launched as {launched} process{'' if launched == 1 else 'es'}; launch it with "
            f"torchrun {nodes}--nproc_per_node {n_gpus_per_node} -m klppo.trainer.main_ppo <the same arguments>"
            f"{' on each node' if nnodes > 1 else ''}, or set {fit} to run on the launch you have")


def update_sizes(cfg: PPOConfig) -> list[UpdateSizes]:
    """The actor's update sizes and, when a critic trains, the critic's (resolved config)."""
    actor, critic = cfg.actor_rollout_ref.actor, cfg.critic
    roles = [UpdateSizes("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                         actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, actor.ppo_epochs)]
    if uses_critic(cfg):
        roles.append(UpdateSizes("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                                 bool(critic.use_dynamic_bsz), critic.ppo_max_token_len_per_gpu, critic.ppo_epochs,
                                 own_mini=critic.ppo_mini_batch_size != actor.ppo_mini_batch_size))
    return roles


def mini_batch_rows(role: UpdateSizes, n: int, world: int) -> int:
    """A rank's rows of each of ``role``'s mini-batches: ``ppo_mini_batch_size * n / world``, floored
    where it does not split evenly (verl's workers: 64 prompts x 5 over 24 ranks train 13 each)."""
    return role.mini_batch_size * n // world


def shard_chunk_rows(cfg: PPOConfig, world: int) -> int:
    """Global rows the trainer deals to the ranks at a time: the gcd of the actor's and critic's
    mini-batches over all ranks (``world x mini_batch_rows``), so each rank's k-th mini-batch is
    its share of the global k-th one."""
    n = cfg.actor_rollout_ref.rollout.n
    return math.gcd(*(world * mini_batch_rows(role, n, world) for role in update_sizes(cfg)))


def divisor_below(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is <= ``limit`` (1 at worst)."""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            best = max([best] + [c for c in (d, n // d) if c <= limit])
    return best


def _ranks(world: int) -> str:
    return f"{world} rank{'' if world == 1 else 's'}"


def _positive(out: Found, key: str, value: Optional[int], what: str) -> None:
    if value is not None and value <= 0:
        out.append(((key,), f"{key} = {value!r} must be > 0; set it to a positive {what}"))


def batch_size_problems(cfg: PPOConfig, world: int) -> Found:
    """Every degenerate batch-size combination of a resolved PPO config on ``world`` ranks."""
    data, arf = cfg.data, cfg.actor_rollout_ref
    out: Found = []
    _positive(out, "data.train_batch_size", data.train_batch_size, "number of prompts")
    _positive(out, "data.val_batch_size", data.val_batch_size, "number of prompts")
    if world >= 1 and data.train_batch_size > 0 and data.train_batch_size % world:
        out.append((("data.train_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes"),
                    f"data.train_batch_size = {data.train_batch_size} prompts do not split evenly over the "
                    f"{_ranks(world)} (trainer.n_gpus_per_node x trainer.nnodes); make it a multiple of {world}"))
    gen = data.gen_batch_size  # dynamic sampling's generation batches split over the ranks too
    if world >= 1 and gen is not None and gen > 0 and gen != data.train_batch_size and gen % world:
        out.append((("data.gen_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes"),
                    f"data.gen_batch_size = {gen} prompts do not split evenly over the {_ranks(world)} "
                    f"(trainer.n_gpus_per_node x trainer.nnodes); make it a multiple of {world}"))
    for role in update_sizes(cfg):
        out += _update_problems(role, data.train_batch_size, arf.rollout.n, world)
    _positive(out, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", arf.rollout.log_prob_micro_batch_size_per_gpu,
              "number of samples")
    _positive(out, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", arf.ref.log_prob_micro_batch_size_per_gpu,
              "number of samples")
    _positive(out, "reward_model.micro_batch_size_per_gpu", cfg.reward_model.micro_batch_size_per_gpu, "number of samples")
    return out + token_budget_problems(cfg)


def _update_problems(role: UpdateSizes, prompts: int, n: int, world: int) -> Found:
    """A mini-batch (prompts) within the step that leaves every rank a sample; a fixed
    micro-batch (samples) that fits a rank's share and divides it."""
    out: Found = []
    mini, micro = role.mini_batch_size, role.micro_batch_size_per_gpu
    if role.own_mini:
        _positive(out, role.mini_key, mini, "number of prompts")
        if mini > prompts > 0:
            out.append(((role.mini_key, "data.train_batch_size"), f"{role.mini_key} = {mini} is larger than "
                        f"data.train_batch_size = {prompts} (prompts per step); set it to {prompts} or less"))
    if not role.use_dynamic_bsz:
        _positive(out, role.micro_key, micro, "number of samples")
    if mini <= 0 or n < 1 or world < 1:
        return out
    if mini * n < world:
        return out + ([_share_problem(role, prompts, n, world)] if role.own_mini else [])
    share = mini_batch_rows(role, n, world)
    if role.use_dynamic_bsz or micro is None or micro <= 0 or share % micro == 0:
        return out
    floored = " floored" if (mini * n) % world else ""
    of_share = (f"a rank's share of the mini-batch ({role.mini_key} {mini} x {ROLLOUT}.n {n} / {_ranks(world)} = "
                f"{share} samples{floored})")
    keys = (role.micro_key, role.mini_key, f"{ROLLOUT}.n", "trainer.n_gpus_per_node", "trainer.nnodes")
    if micro > share:
        return out + [(keys, f"{role.micro_key} = {micro} is larger than {of_share}: set it to {share} or less "
                             f"(a divisor of {share}), or raise {role.mini_key}")]
    return out + [(keys, f"{role.micro_key} = {micro} must divide {of_share}; set it to a divisor such as "
                         f"{divisor_below(share, micro)}")]


def _even_mini_batches(prompts: int, n: int, world: int) -> tuple[int, list[int]]:
    """(step, sizes): mini-batch sizes whose samples split evenly over ``world`` ranks are the
    multiples of ``step``; ``sizes`` are those that also divide the step's ``prompts``."""
    step = world // math.gcd(n, world)
    return step, [m for m in range(step, prompts + 1, step) if prompts % m == 0]


def _nearest_even(mini: int, step: int, sizes: list[int]) -> int:
    """The even size nearest above ``mini`` (else the largest; ``step`` where none divides the step)."""
    return min([m for m in sizes if m >= mini] or sizes[-1:] or [step])


def _share_problem(role: UpdateSizes, prompts: int, n: int, world: int) -> tuple[tuple[str, ...], str]:
    """A mini-batch's samples that leave a rank less than one."""
    mini, samples = role.mini_batch_size, role.mini_batch_size * n
    step, sizes = _even_mini_batches(prompts, n, world)
    keys = (role.mini_key, f"{ROLLOUT}.n", "trainer.n_gpus_per_node", "trainer.nnodes")
    fix = f"set {role.mini_key} to a multiple of {step} such as {_nearest_even(mini, step, sizes)}"
    if not sizes:
        fix += " (and data.train_batch_size to a multiple of it)"
    return keys, (f"{role.mini_key} = {mini} x {ROLLOUT}.n {n} = {samples} samples per mini-batch leave each of "
                  f"the {_ranks(world)} less than one sample (trainer.n_gpus_per_node x trainer.nnodes); {fix}, "
                  "or run on fewer ranks")


def mini_batch_notes(cfg: PPOConfig, world: int) -> list[str]:
    """A warning for each mini-batch size that trains in uneven parts, as verl trains it: samples
    that do not split evenly over the ranks (each rank takes the floor, so a mini-batch is
    smaller than asked), or mini-batches that do not divide the step (the last is smaller).
    Combinations ``batch_size_problems`` refuses get none."""
    prompts, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    if world < 1 or n < 1 or prompts <= 0 or prompts % world:
        return []
    notes = []
    for role in update_sizes(cfg):
        mini = role.mini_batch_size
        if not role.own_mini or mini <= 0 or mini > prompts or mini * n < world:
            continue
        size, samples = world * mini_batch_rows(role, n, world), prompts * n
        full, last = divmod(samples, size)
        if size == mini * n and not last:
            continue
        parts = f"{full} mini-batch{'es' if full > 1 else ''} of {size} samples" + (f" and one of {last}" if last else "")
        uneven = (f" ({mini} x {ROLLOUT}.n {n} = {mini * n} samples do not split evenly over the {_ranks(world)}: "
                  f"each takes {size // world}, as verl's workers floor it)" if size != mini * n else "")
        even = _nearest_even(mini, *_even_mini_batches(prompts, n, world))
        notes.append(f"warning: {role.mini_key} = {mini} trains a step of {samples} samples as {parts}{uneven}, "
                     f"as verl does; {even} would make them equal")
    return notes


def token_budget_problems(cfg: PPOConfig) -> Found:
    """A token budget in use must hold the longest possible sequence (prompt + response)."""
    arf, out = cfg.actor_rollout_ref, []
    longest = longest_sequence(cfg)
    ref = "actor_rollout_ref.ref"
    budgets = [(role.use_dynamic_bsz, f"{role.prefix}.use_dynamic_bsz", role.budget_key, role.max_token_len_per_gpu)
               for role in update_sizes(cfg)]
    budgets[1:1] = [
        (arf.rollout.log_prob_use_dynamic_bsz, f"{ROLLOUT}.log_prob_use_dynamic_bsz",
         f"{ROLLOUT}.log_prob_max_token_len_per_gpu", arf.rollout.log_prob_max_token_len_per_gpu),
        (arf.ref.log_prob_use_dynamic_bsz, f"{ref}.log_prob_use_dynamic_bsz", f"{ref}.log_prob_max_token_len_per_gpu",
         arf.ref.log_prob_max_token_len_per_gpu),
    ]
    reported = set()
    for used, switch, key, budget in budgets:
        if used and 0 < budget < longest and budget not in reported:  # a budget copied from the actor's once
            out.append(((key, switch, "data.max_prompt_length", f"{ROLLOUT}.response_length"),
                        f"{key} = {budget} is smaller than the longest sequence {switch} may meet: "
                        f"data.max_prompt_length + {ROLLOUT}.response_length = {longest} tokens; raise it to at "
                        f"least {longest} (a few times that packs more sequences per micro-batch)"))
            reported.add(budget)
    return out
