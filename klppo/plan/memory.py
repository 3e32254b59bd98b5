"""Peak memory per rank and per phase of a PPO run, estimated from shapes and settings alone.

Each phase's peak is what stays resident through it (every model's weights, the optimisers'
state) plus what the phase adds at its peak: activations of one micro-batch, the LM head's
logits, FSDP2's gathered units, the generation copy and its KV cache, gradients and the
optimiser step's temporaries. The figures are the steady state of a run (the optimiser state
exists from the first update on, so from step 2 every phase holds it), and what klppo's
``perf/peak_memory_gb/<phase>`` measures: ``max_memory_allocated`` on CUDA, the resident set
on CPU (which adds the interpreter and libraries: ``cpu_baseline_bytes``).
``benchmarks/plan_accuracy.py`` compares both, phase by phase.
"""

from __future__ import annotations

from dataclasses import dataclass

from klppo.monitoring.memory import HEAP_TOP_PAD
from klppo.plan.inputs import ModelPlan, PlanSettings
from klppo.plan.model_shape import GOLD_ROLE

FP32 = 4
# The resident set of a CPU rank before any model: Python, torch, transformers, the tokenizer,
# the data: CPU_BASELINE_BYTES and CPU_TOKENIZER_ENTRY_BYTES per entry of the tokenizer. Measured
# 2026-12-04 (torch 2.13.0+cpu, transformers 5.25, memory.py's synthetic tokenizers) as VmRSS after
# those imports and reads: 0.390, 0.410 and 0.490 GiB with 4,096, 32,000 and 151,936 entries
# (0.387 GiB + 720 bytes per entry), by
#   PYTHONPATH=. python benchmarks/plan_accuracy.py --baseline
# A run's own setup reads 0.00-0.02 GiB more (0.49 and 0.43 GiB with 151,936 and 32,000 entries:
# its process, the plan, the data sample); 0.40 GiB lies between.
CPU_BASELINE_BYTES, CPU_TOKENIZER_ENTRY_BYTES = int(0.40 * 2**30), 720
# What a CPU vLLM engine adds beyond its weights and KV cache: vLLM's libraries and the engine's own
# buffers. Measured 2026-12-04 (vllm 0.32.0 CPU build, .venv-vllm) as plan_accuracy's vllm-1 setup
# (1.07 GiB, models mapped and unread) less the baseline, the engine's fp32 weights (0.17) and its
# 64 MiB KV cache: 0.42 GiB, of which 0.075 is .venv-vllm's own larger baseline (0.485 GiB before
# any model against 0.41: its older transformers).
VLLM_CPU_RUNTIME_BYTES = int(0.42 * 2**30)
# klppo.models.fused_head.DEFAULT_CHUNK_LOGITS (a test checks that they agree): logits per slice.
FUSED_CHUNK_LOGITS = 2**24
# Multiples of one slice of fp32 logits the fused head holds at its peak: forward (the slice and
# its exponentials) and backward (the slice recomputed, its softmax and gradient);
# benchmarks/README.md "logits_memory.py" measured 3.4x for forward + backward without grads.
FUSED_FORWARD_SLICES, FUSED_TRAIN_SLICES = 2, 3.5
# Multiples of the (tokens x vocab) fp32 logits the unfused head holds: no-grad log-probs and
# entropy (logits, their fp32 copy, log-softmax) and training with the entropy in the loss
# (logits_memory.py: 6.6x); without it (entropy_coeff 0, the entropy measured without a
# gradient), 4.8x (longnaive-1 of plan_accuracy.py, 2026-12-05: its update 3.48 GiB measured).
NAIVE_FORWARD_LOGITS, NAIVE_TRAIN_LOGITS, NAIVE_TRAIN_LOGITS_NO_ENTROPY = 3, 6.6, 4.8

PHASES = ("setup", "weight_sync", "gen", "kl_probe", "old_log_prob", "ref", "values", "reward", "update_critic", "update_actor",
          "validate", "export")


@dataclass(frozen=True)
class PhaseMemory:
    """One phase's estimated peak on one rank: (what, bytes) items that add up to ``total``."""

    phase: str
    items: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)


# ---- what each model holds ----


def on_device(m: ModelPlan, s: PlanSettings, active: bool) -> bool:
    """Whether a model's parameters sit in device memory now: offload moves them to the host
    between its phases (``param_offload``), or always (``offload_policy``); a no-op on CPU runs."""
    if s.device != "cuda":
        return True
    return not m.offload_policy and (active or not m.param_offload)


def root_parameters(m: ModelPlan) -> int:
    """The root FSDP unit's own parameters: embedding, final norm and an untied LM head."""
    return m.shape.embedding_parameters + m.shape.lm_head_parameters + m.shape.hidden_size


def weight_bytes(m: ModelPlan) -> int:
    """fp32 parameters per rank: a shard of each, but a LoRA model's frozen fp32 root is kept whole
    (``apply_fsdp2(replicate_frozen_root=...)``)."""
    if m.lora_rank and m.shards > 1 and m.compute_bytes == FP32:
        root = root_parameters(m)
        return (root + (m.parameters - root) // m.shards) * FP32
    return m.parameters * FP32 // m.shards


def gradient_bytes(m: ModelPlan) -> int:
    return m.trainable * FP32 // m.shards  # reduced in fp32 (reduce_dtype) onto each rank's shard


def optimizer_bytes(m: ModelPlan) -> int:
    """The optimiser's state per rank (AdamW: exp_avg and exp_avg_sq, fp32; ``optim.optimizer`` sets how much)."""
    return int(m.optimizer_state_floats * m.trainable) * FP32 // m.shards


def gathered_bytes(m: ModelPlan) -> int:
    """FSDP2's all-gathered units at a forward's peak: the root, gathered for the whole forward (twice
    while it gathers: its buffer and the copy out), and a decoder block with the next prefetched."""
    if m.shards == 1:
        return 0
    layers = m.parameters - root_parameters(m)
    root = 0 if (m.lora_rank and m.compute_bytes == FP32) else root_parameters(m)
    return (root + max(root, 2 * layers // m.shape.num_hidden_layers)) * m.compute_bytes


def optimizer_on_device(m: ModelPlan, s: PlanSettings, active: bool) -> bool:
    """Whether a model's optimiser state sits in device memory now (it exists once the model has
    been updated): ``optimizer_offload`` moves it to the host outside the update, ``offload_policy``
    keeps it there; a no-op on CPU runs."""
    if s.device != "cuda":
        return bool(m.trainable)
    return bool(m.trainable) and not m.offload_policy and (active or not m.optimizer_offload)


def resident_items(s: PlanSettings, active: tuple[str, ...], updated: tuple[str, ...]) -> list[tuple[str, int]]:
    """Weights, and the optimiser state of the ``updated`` models, in device memory through a phase
    that uses the models ``active``."""
    items = []
    for m in s.models:
        if on_device(m, s, m.role in active):
            items.append((f"{m.role} weights", weight_bytes(m)))
        if m.role in updated and optimizer_on_device(m, s, m.role in active):
            items.append((f"{m.role} optimiser", optimizer_bytes(m)))
    return items


# ---- activations ----


def layer_activation_elements(m: ModelPlan) -> int:
    """Elements a decoder block saves per token for backward (transformers' Llama/Qwen2 layer): its two
    RMSNorms' inputs and outputs (4h), q, k, v with rotated q and k, the attention output and
    o_proj's input (4q + 3kv), and the MLP's gate, up, SiLU(gate) and product (4 x its width: a
    mixture of experts', the experts a token is routed to, and ``routed_copies``)."""
    sh = m.shape
    q, kv = sh.num_attention_heads * sh.head_dim, sh.num_key_value_heads * sh.head_dim
    return 4 * sh.hidden_size + 4 * q + 3 * kv + 4 * sh.mlp_width + routed_copies(sh)


def routed_copies(sh) -> int:
    """Elements a mixture of experts' layer holds per token beyond its experts' MLPs, averaged over
    the decoder layers: each routed expert's copy of the token's hidden state and its output, 2 x
    hidden per expert a token goes to, on the layers that route. Measured on transformers' grouped
    experts (Qwen3-MoE, saved tensors of one layer's backward: k x (4 x expert width + 2 x hidden)
    within 0.3% for top-k 1 to 4, hidden 512 and 1024, widths 768 and 1536, 8 and 16 experts)."""
    return 2 * sh.hidden_size * sh.routed_experts * sh.sparse_layers // max(sh.num_hidden_layers, 1)


def training_activation_bytes(m: ModelPlan, tokens: int) -> int:
    """Saved activations of one micro-batch: every block's (or, checkpointed, every block's input plus
    one block recomputed at a time)."""
    per_layer = layer_activation_elements(m) * tokens * m.compute_bytes
    if m.checkpointing:
        return m.shape.num_hidden_layers * m.shape.hidden_size * tokens * m.compute_bytes + per_layer
    return m.shape.num_hidden_layers * per_layer


def forward_activation_bytes(m: ModelPlan, tokens: int) -> int:
    """A no-grad forward keeps one block's intermediates at a time: the residual stream, the MLP's
    gate, up and product."""
    return tokens * (3 * m.shape.hidden_size + 3 * m.shape.mlp_width + routed_copies(m.shape)) * m.compute_bytes


def lm_head_bytes(s: PlanSettings, m: ModelPlan, response_tokens: int, training: bool) -> int:
    """The LM head's logits at the response tokens: slices of FUSED_CHUNK_LOGITS (fused), or whole."""
    if s.fused_head:
        slices = FUSED_TRAIN_SLICES if training else FUSED_FORWARD_SLICES
        hidden = response_tokens * m.shape.hidden_size * FP32 if training else 0
        return int(slices * min(FUSED_CHUNK_LOGITS, response_tokens * m.shape.vocab_size) * FP32) + hidden
    if not training:
        scale = NAIVE_FORWARD_LOGITS
    else:
        scale = NAIVE_TRAIN_LOGITS if s.entropy_in_loss else NAIVE_TRAIN_LOGITS_NO_ENTROPY
    return int(scale * response_tokens * m.shape.vocab_size * FP32)


def optimizer_step_bytes(s: PlanSettings, m: ModelPlan) -> int:
    """Temporaries of AdamW's step: on CPU (single-tensor AdamW) two of the largest trainable shard
    (``exp_avg_sq.sqrt() / bias_correction``); CUDA's fused kernel, none."""
    if s.device == "cuda" or not m.trainable:
        return 0
    largest = m.shape.embedding_parameters if m.trainable == m.parameters else max(m.shape.hidden_size, m.shape.intermediate_size) * m.lora_rank
    return 2 * largest * FP32 // m.shards


# ---- the phases ----


def cpu_baseline_bytes(s: PlanSettings) -> int:
    """A CPU rank's resident set before any model: the interpreter and libraries, and the tokenizer
    (about 0.7 KiB per entry; the actor's vocabulary stands for it)."""
    return CPU_BASELINE_BYTES + CPU_TOKENIZER_ENTRY_BYTES * s.model("actor").shape.vocab_size


def _base(s: PlanSettings) -> list[tuple[str, int]]:
    return [("interpreter and libraries", cpu_baseline_bytes(s))] if s.device != "cuda" else []


def update_items(s: PlanSettings, m: ModelPlan, tokens: int, response_tokens: int,
                 first: bool = False) -> list[tuple[str, int]]:
    """A model's update beyond what stays resident: the larger of backward's start (every saved
    activation, the head's logits and its gradient, the units gathered) and the optimiser step
    (every gradient and the step's temporaries; in the ``first`` update, the state it creates)."""
    grads = gradient_bytes(m) if not (s.device == "cuda" and m.offload_policy) else 0
    head = lm_head_bytes(s, m, response_tokens, training=True) if m.role == "actor" else 0
    # The LM head's weight gradient (the embedding's, when tied) comes first in backward, beside
    # every activation; a value head's is a few numbers, and the embedding's comes last.
    first_grads = m.shape.vocab_size * m.shape.hidden_size * FP32 // m.shards if (
        m.role == "actor" and m.trainable == m.parameters and grads) else 0
    backward = [("activations", training_activation_bytes(m, tokens)), ("LM head logits", head),
                ("gathered units", gathered_bytes(m)), ("head gradients", first_grads)]
    step = [("gradients", grads), ("optimiser step", optimizer_step_bytes(s, m))]
    if first and optimizer_on_device(m, s, True):
        step.append((f"{m.role} optimiser", optimizer_bytes(m)))
    return backward if sum(b for _, b in backward) > sum(b for _, b in step) else step


def forward_items(s: PlanSettings, m: ModelPlan, tokens: int, response_tokens: int) -> list[tuple[str, int]]:
    """A no-grad forward's peak: the decoder blocks' intermediates, or after them the LM head's logits
    beside the last hidden states, whichever is larger (one is freed before the other comes; a
    CPU run of ~16k tokens through 4 blocks, hidden 512, measured 0.35 GiB against 0.50 for both)."""
    blocks = forward_activation_bytes(m, tokens)
    head = 0
    if m.role in ("actor", "ref"):
        head = lm_head_bytes(s, m, response_tokens, training=False) + tokens * m.shape.hidden_size * m.compute_bytes
    peak = ("activations", blocks) if blocks >= head else ("LM head logits", head)
    return [peak, ("gathered units", gathered_bytes(m))]


def generation_items(s: PlanSettings, rows: int, tokens: int) -> list[tuple[str, int]]:
    """HF generate: a copy of the actor's weights where it needs one (``PlanSettings.generation_copy``)
    and every row's KV cache, in the compute dtype (FSDP2's mixed precision computes in it, and so
    does the copy); vLLM: the engine (``engine_items``)."""
    actor = s.model("actor")
    sh = actor.shape
    if s.rollout == "vllm":
        return engine_items(s)
    items = [("generation copy", generation_copy_bytes(s)), ("KV cache", kv_cache_bytes(s, rows, tokens))]
    items.append(("last-token logits", 2 * rows * sh.vocab_size * FP32))
    if not s.generation_copy:
        items.append(("gathered units", gathered_bytes(actor)))
    return items


def generation_copy_bytes(s: PlanSettings) -> int:
    actor = s.model("actor")
    return actor.parameters * actor.compute_bytes if s.generation_copy else 0


def kv_cache_bytes(s: PlanSettings, rows: int, tokens: int) -> int:
    """HF generate's KV cache of ``rows`` rows of ``tokens`` tokens, in the actor's compute dtype."""
    actor = s.model("actor")
    sh = actor.shape
    return rows * tokens * sh.num_hidden_layers * 2 * sh.num_key_value_heads * sh.head_dim * actor.compute_bytes


def kept_generation_items(s: PlanSettings) -> list[tuple[str, int]]:
    """What HF generation keeps between generations (``PlanSettings.generation_kept``): the copy, and
    the static KV cache of the step's generation (online) or of the KL probe (offline); held through
    the phases that do not generate."""
    if not s.generation_kept:
        return []
    rows = s.passes.gen_rows or s.passes.probe_rows
    if not rows:
        return []
    return [("generation copy", generation_copy_bytes(s)), ("KV cache", kv_cache_bytes(s, rows, s.passes.gen_tokens))]


def engine_items(s: PlanSettings) -> list[tuple[str, int]]:
    """The vLLM engine: its weights and KV cache, or on a GPU without ``kv_cache_memory_bytes`` its share
    of the device (``gpu_memory_utilization``, both in it); on CPU also vLLM's own libraries and
    buffers. Held from the engine's start in setup; outside generation too unless it sleeps."""
    if s.rollout != "vllm":
        return []
    if s.engine_kv_bytes is None and s.device == "cuda":
        return [("vLLM engine (gpu_memory_utilization)", -1)]  # filled in by the caller: a share of the device
    actor = s.model("actor")
    items = [("vLLM engine weights", actor.parameters * s.engine_bytes // s.engine_tp),
             ("vLLM KV cache", s.engine_kv_bytes or 0)]
    if s.device != "cuda":
        items.append(("vLLM libraries and buffers", VLLM_CPU_RUNTIME_BYTES))
    return items


def weight_sync_items(s: PlanSettings) -> list[tuple[str, int]]:
    """Streaming the actor's weights into the vLLM engine (``responses.sync_engine_weights``): one
    decoder block's whole tensors at a time, or a run of the root's (the embedding is the largest),
    gathered in fp32 where the actor is sharded or merged with its LoRA adapters (one process's own
    tensors otherwise), and each cast to the engine's dtype as the engine copies it in; a sleeping
    engine wakes its weights first, not its KV cache."""
    if s.rollout != "vllm":
        return []
    actor = s.model("actor")
    sh = actor.shape
    block = (actor.parameters - root_parameters(actor)) // sh.num_hidden_layers
    largest = max(sh.embedding_parameters, sh.lm_head_parameters, block)
    gathered = largest * FP32 if actor.shards > 1 or actor.lora_rank else 0
    items = [("vLLM weights being streamed", gathered + sh.embedding_parameters * s.engine_bytes)]
    if s.engine_sleeps:
        items.insert(0, ("vLLM engine weights", actor.parameters * s.engine_bytes // s.engine_tp))
    return items


def probe_items(s: PlanSettings, p) -> list[tuple[str, int]]:
    """The offline KL probe samples with the generation copy and scores its samples with the actor
    and the reference while the copy is still held: generation plus one scoring forward."""
    scoring = forward_items(s, s.model("actor"), p.probe_rows * p.gen_tokens, p.probe_rows * p.gen_response_tokens)
    return generation_items(s, p.probe_rows, p.gen_tokens) + scoring


def mapped(s: PlanSettings, m: ModelPlan) -> bool:
    """Whether a model's weights stay mapped from its safetensors files after loading: one process
    loads with ``from_pretrained``, which, when the file holds every tensor in the fp32 the model
    trains in, maps the file and keeps its tensors instead of copying them; the kernel reads a
    page in on first use. A CPU process's resident set holds none of it until then (a GPU copies
    the weights to the device). A folder converted as it loads (``converts_on_load``) is copied."""
    return s.whole_loads and s.device != "cuda" and _fp32_file(m) and not m.shape.converts_on_load


def _fp32_file(m: ModelPlan) -> bool:
    """The model's files hold every tensor in fp32, the dtype it trains in."""
    return bool(m.shape.disk_dtypes) and all(d == "F32" for d, _ in m.shape.disk_dtypes)


def setup_items(s: PlanSettings) -> list[tuple[str, int]]:
    """Loading beyond the weights that stay: one process converts a file in another dtype with its
    pages read (the largest such file, on CPU) and maps an fp32 one (``mapped``: nothing read
    yet; one converted as it loads, its fused experts copied, is read no further: moelong-1 of
    ``benchmarks/plan_accuracy.py``); sharded ranks fill their shards one tensor at a time, the
    largest (the embedding) gathered in fp32 at most."""
    actor = s.model("actor")
    if not s.whole_loads:
        items = [("largest tensor being filled", actor.shape.embedding_parameters * FP32 // actor.shards)]
        if s.device != "cuda":  # rank 0 converts such a folder whole (models.sharded_load.ConvertedWeights)
            items.append(("converted folder (rank 0)", converted_load_bytes(s)))
        return items
    if s.device == "cuda":
        return []  # the file is read in host memory; the device holds the weights
    read = [_disk_bytes(m) for m in s.models if not _fp32_file(m)]
    return [("weights file being read", max(read, default=0))]


def converted_load_bytes(s: PlanSettings) -> int:
    """Host memory rank 0 holds while the ranks fill their shards from a folder converted as it loads
    (``converts_on_load``): the model whole in the folder's dtype, the largest such model's."""
    return max((_disk_bytes(m) for m in s.models if m.shape.converts_on_load), default=0)


def _disk_bytes(m: ModelPlan) -> int:
    return sum(n * _dtype_bytes(d) for d, n in m.shape.disk_dtypes) or m.parameters * FP32


def _dtype_bytes(safetensors_dtype: str) -> int:
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}.get(
        safetensors_dtype, 4)


def _phase(name: str, s: PlanSettings, active: tuple[str, ...], extra: list[tuple[str, int]],
           updated: tuple[str, ...], heap: "KeptHeap | None" = None) -> PhaseMemory:
    extra = [(k, b) for k, b in extra if b]
    kept = heap.items(name, extra) if heap is not None else []
    return PhaseMemory(name, tuple(_base(s) + resident_items(s, active, updated) + extra + kept))


class KeptHeap:
    """Freed memory glibc keeps resident at its heap's top for reuse on CPU (``HEAP_TOP_PAD``, which
    ``run.setup.return_freed_memory`` sets in every run), from the first phase that allocates
    transients on (in the first step; the steady state has it from the start): that phase grows
    it about halfway, and each later phase holds it beside its own transients, but an update,
    whose many mid-size blocks (saved activations, gradients) are carved from it. Measured on
    ``benchmarks/plan_accuracy.py``'s long-1, moelong-1 and full-2 (2026-12-05): the first forward
    +0.22 to +0.41 GiB, later forwards and the reward phase +0.45 to +0.60, updates -0.2 to +0.08
    against the same runs before the pad. A run with a CPU vLLM engine measured +0.07 to +0.15 in
    every phase (vllm-1; why it keeps so little is not known): none is planned there."""

    def __init__(self, s: PlanSettings, first_step: bool):
        # In the steady state, the first step has grown it.
        self.pad = HEAP_TOP_PAD if s.device != "cuda" and s.rollout != "vllm" else 0
        self.grown = not first_step

    def items(self, phase: str, extra: list[tuple[str, int]]) -> list[tuple[str, int]]:
        transient = sum(b for _, b in extra)
        if not self.grown:
            self.grown = transient > 0
            kept = self.pad // 2 if self.grown else 0
        else:
            kept = max(0, self.pad - transient) if phase.startswith("update") else self.pad
        return [("freed heap glibc keeps", kept)] if kept else []


def phase_estimates(s: PlanSettings, first_step: bool = False) -> list[PhaseMemory]:
    """Every phase this run has, in the loop's order, with its estimated peak per rank: in the
    steady state (every optimiser's state exists), or in the ``first_step``, before the updates
    create it (the critic's exists in the actor's update: the critic updates first) and before
    the phases read the weights of mapped files (``_mapped_when_read``)."""
    p, actor, critic, rm = s.passes, s.model("actor"), s.model("critic"), s.model("reward_model")
    ref = s.model("ref") or (actor if s.uses_reference else None)
    trained = tuple(m.role for m in s.models if m.trainable)
    before = () if first_step else trained
    gen = generation_items(s, p.gen_rows, p.gen_tokens)
    scoring = forward_items(s, actor, p.forward_tokens, p.forward_response_tokens)
    held = ([] if s.engine_sleeps else engine_items(s)) + kept_generation_items(s)  # a CPU engine has no sleep mode
    heap = KeptHeap(s, first_step)  # every phase after setup's loading
    out = [_phase("setup", s, (), setup_items(s) + engine_items(s), ())]
    if s.rollout == "vllm":
        out.append(_phase("weight_sync", s, ("actor",), weight_sync_items(s), before, heap))
    out.append(_phase("gen", s, ("actor",), gen if s.rollout != "offline" else [], before, heap))
    if p.probe_rows:
        out.append(_phase("kl_probe", s, ("actor", "ref"), probe_items(s, p), before, heap))
    if s.old_log_prob_forward:
        out.append(_phase("old_log_prob", s, ("actor",), scoring, before, heap))
    if ref is not None:
        out.append(_phase("ref", s, (ref.role,), forward_items(s, ref, p.forward_tokens, p.forward_response_tokens),
                          before, heap))
    if critic is not None and not s.update_forwards_first:
        out.append(_phase("values", s, ("critic",), forward_items(s, critic, p.forward_tokens, 0), before, heap))
    out.append(_phase("reward", s, ("reward_model",), forward_items(s, rm, p.forward_tokens, 0) if rm else [], before,
                      heap))
    if critic is not None:
        # With the forwards first, the actor's forward ran before the critic's update and its graph waits.
        held_actor = [("actor activations awaiting its update", training_activation_bytes(actor, p.update_tokens))
                      ] if s.update_forwards_first else []
        out.append(_phase("update_critic", s, ("critic",),
                          update_items(s, critic, p.critic_tokens, 0, first_step) + held_actor, before, heap))
    after_critic = trained if not first_step else tuple(r for r in trained if r == "critic")
    out.append(_phase("update_actor", s, ("actor",),
                      update_items(s, actor, p.update_tokens, p.update_response_tokens, first_step), after_critic, heap))
    out.append(_phase("validate", s, ("actor", "ref", "reward_model", GOLD_ROLE), gen if s.rollout != "offline" else scoring,
                      trained, heap))
    out.append(_phase("export", s, ("actor",), [("tensor being exported", 2 * actor.shape.embedding_parameters * FP32)],
                      trained, heap))
    return [_engine_share(_holding(phase, held), s) for phase in _mapped_when_read(out, s, first_step)]


# The models whose weights each phase reads (offline, generation reads none).
READS = {"weight_sync": ("actor",), "gen": ("actor",), "kl_probe": ("actor", "ref"), "old_log_prob": ("actor",), "ref": ("ref",),
         "values": ("critic",), "reward": ("reward_model",), "update_critic": ("critic",), "update_actor": ("actor",),
         "validate": ("actor", "ref", "reward_model", GOLD_ROLE), "export": ("actor",)}


def _mapped_when_read(phases: list[PhaseMemory], s: PlanSettings, first_step: bool) -> list[PhaseMemory]:
    """Mapped weights (``mapped``) come into memory as a phase first reads them: none in setup; in the
    first step, each model's from its first phase on (after it, they stay: the steady state)."""
    read, out = set(), []
    for phase in phases:
        read |= set(() if phase.phase == "gen" and s.rollout == "offline" else READS.get(phase.phase, ()))
        unread = {f"{m.role} weights" for m in s.models
                  if mapped(s, m) and (phase.phase == "setup" or (first_step and m.role not in read))}
        out.append(PhaseMemory(phase.phase, tuple(item for item in phase.items if item[0] not in unread)))
    return out


def _holding(phase: PhaseMemory, held: list[tuple[str, int]]) -> PhaseMemory:
    """A phase with what stays resident through it (``held``: the vLLM engine, HF generation's kept
    model and caches): every phase but setup, which builds the engine before any generation; a
    phase that generates counts its own (an item of the same name) already."""
    if phase.phase == "setup":
        return phase
    own = {name for name, _ in phase.items}
    return PhaseMemory(phase.phase, phase.items + tuple((k, b) for k, b in held if b and k not in own))


def _engine_share(phase: PhaseMemory, s: PlanSettings) -> PhaseMemory:
    """A GPU engine without ``kv_cache_memory_bytes`` takes ``gpu_memory_utilization`` of the device's
    memory wherever it is held."""
    items = tuple((k, int(s.engine_share * s.device_bytes) if b == -1 else b) for k, b in phase.items)
    return PhaseMemory(phase.phase, items)


def peak_phase(phases: list[PhaseMemory]) -> PhaseMemory:
    return max(phases, key=lambda p: p.total)
