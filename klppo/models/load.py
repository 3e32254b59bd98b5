"""Load the actor, reference, critic and tokenizer from local Hugging Face folders.

Nothing is fetched from a hub: a path that is not a folder holding a config is a
``UserError`` naming the config key. The critic is ``AutoModelForTokenClassification`` with
one label on the actor's backbone (verl's choice): the backbone weights come from the folder,
the one-output value head is freshly initialised, and the result saves and loads as an
ordinary Hugging Face model. A type that transformers gives no such class (nor a reward
model's) gets one composed of transformers' own generic head and backbone (``model_class``).

Loading runs no code from a folder: every ``from_pretrained`` is called with
``trust_remote_code=False``, and weights load with ``weights_only=True`` (safetensors, or a
``pytorch_model.bin`` read by torch's weights-only unpickler, which builds tensors and plain
containers and refuses anything else). A folder that cannot give a usable model (no or damaged
weights, weights missing from the backbone, a tokenizer that cannot encode text) is a
``UserError`` naming the folder and the fix, before any training starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from klppo.errors import UserError, reading, reason
from klppo.models.attention import packing_problem
from klppo.models.heads import is_causal_lm_class, model_class
from klppo.models.rng import seeded

# The weight files from_pretrained reads (transformers' names), the safe format first.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
# Text every usable tokenizer turns into tokens (a tokenizer built without its files maps it to nothing).
_PROBE = "The quick brown fox jumps over the lazy dog. What is 12 + 30? It is 42."
_SAFE = {"trust_remote_code": False}


def check_model_folder(path: str, key: str) -> Path:
    """Return ``path`` as a Path if it is a local model folder, else raise naming ``key``."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{key}: model folder '{path}' does not exist; point {key} at a local Hugging Face folder")
    if not (folder / "config.json").is_file():
        raise UserError(
            f"{key}: '{path}' has no config.json, so it is not a Hugging Face model folder; "
            "point it at the folder that save_pretrained wrote"
        )
    return folder


def check_weight_files(folder: Path, key: str) -> None:
    """The folder holds weights that from_pretrained can find: one of ``WEIGHT_FILES`` (and every shard an
    index lists)."""
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise UserError(f"{key}: '{folder}' holds no model weights ({' or '.join(WEIGHT_FILES[::2])}); "
                        "point it at a folder that save_pretrained wrote, with its weights")
    if present[0].endswith(".index.json"):
        with reading(folder / present[0], f"{key}: the weight index", "save the model again with save_pretrained"):
            shards = set(json.loads((folder / present[0]).read_text())["weight_map"].values())
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise UserError(f"{key}: '{folder}' lacks the weight shard '{missing[0]}' that {present[0]} lists; "
                            "copy the folder again, whole")


def _weights_fix(folder: Path) -> str:
    if not any((folder / name).is_file() for name in WEIGHT_FILES[:2]):
        return ("the folder has only pickled weights (pytorch_model.bin), which klppo reads as plain tensors only: "
                "convert them to safetensors from a copy you trust (save_pretrained), or copy the folder again")
    return "the weights are damaged or incomplete: copy the folder again, or save the model again with save_pretrained"


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant autograd), in the
    installed transformers' spelling: ``activation_checkpointing_enable`` where it has it (5.2x),
    whose older name ``gradient_checkpointing_enable`` warns there that it goes in v6."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _from_pretrained(auto_class, folder: Path, key: str, **kwargs) -> PreTrainedModel:
    """``auto_class.from_pretrained`` with no remote code and weights-only loading; a failure names the folder.

    Weights the model has but the folder lacks are refused, except a freshly initialised head (a
    critic's or reward model's one-output layer on a language model's backbone).
    """
    check_weight_files(folder, key)
    from klppo.models.sharded_load import empty_model

    config = kwargs.pop("config", None) or _model_config(folder, key)
    check_weight_shapes(empty_model(auto_class, config), folder, key)
    with reading(folder, f"{key}: model folder", _weights_fix(folder)):
        model, info = model_class(auto_class, type(config)).from_pretrained(
            folder, config=config, weights_only=True, output_loading_info=True, **_SAFE, **kwargs)
    backbone = f"{model.base_model_prefix}."
    missing = sorted(k for k in info["missing_keys"] if auto_class is AutoModelForCausalLM or k.startswith(backbone))
    if missing:
        raise UserError(f"{key}: the weights in '{folder}' lack '{missing[0]}' ({len(missing)} tensors missing); "
                        "copy the folder again, or save the model again with save_pretrained")
    return model


def saved_shapes(folder: Path, key: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the folder's weights (``check_weight_files`` has passed), from
    the files' headers (safetensors) or a weights-only, memory-mapped read onto the meta device
    (``pytorch_model.bin``). A file that cannot be read is refused as the loaders refuse it."""
    from safetensors import safe_open

    name = next(name for name in WEIGHT_FILES if (folder / name).is_file())
    if name.endswith(".index.json"):
        files = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
    else:
        files = [name]
    shapes = {}
    with reading(folder, f"{key}: model folder", _weights_fix(folder)):
        for file in files:
            if file.endswith(".safetensors"):
                with safe_open(str(folder / file), framework="pt") as f:
                    shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            else:
                tensors = torch.load(folder / file, map_location="meta", weights_only=True, mmap=True)
                shapes.update({k: tuple(t.shape) for k, t in tensors.items()})
    return shapes


def as_saved(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (whole tensors of ``model``, by its own names) under the names and in the layout
    that ``save_pretrained`` writes: transformers 5 converts some tensors as it loads a folder
    (every layer's MoE experts, stored one by one, become one fused tensor; Mixtral's router is
    renamed) and reverts that as it saves, and inference engines (vLLM) and other readers take the
    saved layout. ``tensors`` must hold every tensor that a saved one comes from: one decoder
    block's do. A model that transformers converts nothing of gets them as they are."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def check_weight_shapes(model: PreTrainedModel, folder: Path, key: str) -> None:
    """Every tensor the folder holds for a parameter of ``model`` (built from its config, on the meta
    device) has that parameter's shape.

    One check for both loading paths: ``from_pretrained`` refuses a mismatch with a message that
    points at a report logged elsewhere, and the sharded load fails in the copy into a shard
    with a bare RuntimeError. A classifier saved with two labels where klppo needs one output
    (a reward model, a critic) is the usual case.
    """
    saved = saved_shapes(folder, key)
    for name, param in model.named_parameters():
        if name in saved and saved[name] != tuple(param.shape):
            one_output = "; a reward model or critic has one output (num_labels=1)" \
                if not name.startswith(f"{model.base_model_prefix}.") else ""
            raise UserError(f"{key}: '{name}' in '{folder}' has shape {list(saved[name])}, but the model that config.json "
                            f"describes needs {list(param.shape)}{one_output}; copy the folder again, or save the model "
                            "again with save_pretrained")


def _model_config(folder: Path, key: str):
    path, fix = folder / "config.json", "save the model again with save_pretrained"
    with reading(path, f"{key}: the model config", fix):
        raw = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(raw, dict) and "auto_map" in raw and raw.get("model_type") not in CONFIG_MAPPING:
        raise UserError(f"{key}: '{folder}' needs the Python code its config.json names (auto_map), and klppo never "
                        "runs code from a model folder; use a model whose architecture transformers ships")
    with reading(path, f"{key}: the model config", fix):
        return AutoConfig.from_pretrained(folder, **_SAFE)


def packing_problem_of(path: str, key: str) -> str | None:
    """Why the model of folder ``path`` (set by ``key``) cannot keep the sequences of a packed row
    apart (``klppo.models.attention.packing_problem``), or None; read from its config.json alone."""
    return packing_problem(_model_config(check_model_folder(path, key), key))


def load_tokenizer(path: str, key: str = "actor_rollout_ref.model.path", chat_template: str | None = None,
                   template_key: str = "actor_rollout_ref.model.custom_chat_template",
                   tokenizer_path: str | None = None,
                   tokenizer_key: str = "actor_rollout_ref.model.tokenizer_path") -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model (or in ``tokenizer_path``, set by ``tokenizer_key``), left-padding,
    with a pad token (EOS if it had none); checked against the model's config either way.

    A tokenizer without a chat template (a base model's) is accepted: plain-text prompts need
    none, and the data readers refuse chat-message prompts without one, naming the row.
    ``chat_template`` (set by ``template_key``) replaces the saved template; a copy saved from
    this tokenizer carries it.
    """
    config = _model_config(check_model_folder(path, key), key)  # first: AutoTokenizer reads config.json too
    if tokenizer_path is not None:
        key, path = tokenizer_key, tokenizer_path
        if not Path(path).is_dir():
            raise UserError(f"{key} = {path!r} is not a folder; point it at a folder a tokenizer was saved to "
                            "(tokenizer.save_pretrained), or leave it null to read the one next to the model")
    folder = Path(path)
    fix = "save the tokenizer next to the model (tokenizer.save_pretrained)" if tokenizer_path is None else \
        "save the tokenizer there (tokenizer.save_pretrained)"
    with reading(folder, f"{key}: the tokenizer in", fix):
        tokenizer = AutoTokenizer.from_pretrained(folder, **_SAFE)
    check_tokenizer_usable(tokenizer, config, folder, key)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    check_chat_template(tokenizer, folder, key, template_key if chat_template is not None else None)
    if tokenizer.eos_token_id is None:
        raise UserError(f"{key}: the tokenizer in '{path}' has no eos_token; set one and save it again")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_token_ids_fit(tokenizer, config, folder, key)
    tokenizer.padding_side = "left"
    return tokenizer


def check_token_ids_fit(tokenizer: PreTrainedTokenizerBase, config, folder: Path, key: str) -> None:
    """Refuse a tokenizer with ids that have no embedding row.

    EOS closes every response, PAD fills every batch, BOS starts plain-text prompts, and every
    added token (a chat template's markers, a fine-tune's new words, an unk token) comes out of
    encoding wherever its text appears in a prompt; an id at or past the model's ``vocab_size``
    rows is an IndexError at the first forward on CPU and a device-side assert on a GPU, after
    the run has started. Tokens added after training without a resize of the model's embeddings
    are the usual cause; a Qwen2 folder whose tokenizer_config.json names no unk token is the
    other (``Qwen2Tokenizer`` then adds ``<|endoftext|>`` past the trained ids).
    """
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if not rows:
        return
    named = [(role, getattr(tokenizer, role), getattr(tokenizer, f"{role}_id"))
             for role in ("eos_token", "pad_token", "bos_token", "unk_token")]
    added = [("token", str(token), i) for i, token in sorted(tokenizer.added_tokens_decoder.items())]
    largest = max(tokenizer.get_vocab().items(), key=lambda item: item[1], default=None)
    vocabulary = [("token", largest[0], largest[1])] if largest else []
    for role, token, token_id in named + added + vocabulary:
        if token_id is not None and not 0 <= token_id < rows:
            raise UserError(
                f"{key}: the tokenizer in '{folder}' has {role} {token!r} at id {token_id}, but the model has {rows} "
                f"embedding rows (ids 0 to {rows - 1}); {_ids_fix(role)}")


def _ids_fix(role: str) -> str:
    fix = ("use the model's own tokenizer, or resize the model's embeddings to it "
           "(model.resize_token_embeddings(len(tokenizer))) and save both")
    if role == "unk_token":  # a byte-level BPE encodes any text and needs no unk token
        return f"{fix}; a tokenizer without unknown input (byte-level BPE) takes \"unk_token\": null in tokenizer_config.json"
    return fix


def check_tokenizer_usable(tokenizer: PreTrainedTokenizerBase, config, folder: Path, key: str) -> None:
    """Refuse a tokenizer that cannot stand for the model's vocabulary.

    transformers 5 builds a near-empty tokenizer when a folder lacks tokenizer.json; it encodes
    ordinary text to nothing (or to unknown tokens), and a run trained on it has loss nan. A
    vocabulary under half the model's embedding rows is the same mistake in a milder form (real
    models pad their embeddings by far less).
    """
    fix = "save the model's own tokenizer next to it (tokenizer.save_pretrained), tokenizer.json included"
    with reading(folder, f"{key}: the tokenizer in", fix):
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    unknown = tokenizer.unk_token_id
    if not ids or all(i == unknown for i in ids):
        raise UserError(f"{key}: the tokenizer in '{folder}' turns ordinary text into no tokens "
                        f"(its vocabulary has {len(tokenizer)} entries); {fix}")
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows and len(tokenizer) < rows // 2:
        raise UserError(f"{key}: the tokenizer in '{folder}' has {len(tokenizer)} tokens but the model has {rows} "
                        f"embedding rows, so it is not the model's tokenizer; {fix}")


def _template_file(folder: Path) -> Path:
    """Where the tokenizer's chat template was read from (transformers 5 saves it on its own)."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return folder / name
    return folder / "tokenizer_config.json"


def check_chat_template(tokenizer: PreTrainedTokenizerBase, folder: Path, key: str,
                        template_key: str | None = None) -> None:
    """Refuse a chat template that cannot render the simplest conversation, naming its file (or
    ``template_key``, the config key that set it).

    The data readers render every row and name the row a template fails on, which is right when
    the template refuses that row's messages (``raise_exception``: roles must alternate, no system
    message, ...) and wrong when the template itself is broken (a Jinja syntax error, an undefined
    name, a method a string lacks): then it fails on every row, and row 0 would be blamed. One
    user message with the generation prompt is the probe; a template that refuses even that on
    purpose is left to the rows.
    """
    import jinja2

    if getattr(tokenizer, "chat_template", None) is None:  # a base model's; chat-message rows are refused
        return
    probe = [{"role": "user", "content": _PROBE}]
    try:
        tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the folder's Jinja code
        if type(exc) is jinja2.TemplateError:  # raise_exception() in the template: a refusal, not a fault
            return
        if template_key is not None:
            raise UserError(f"{template_key}: the chat template cannot render even one user message ({reason(exc)}); "
                            "fix the template, or remove the key to use the one saved with the tokenizer") from None
        raise UserError(f"{key}: the chat template in '{_template_file(folder)}' cannot render even one user message "
                        f"({reason(exc)}); fix the template, or save the model's own tokenizer next to it "
                        "(tokenizer.save_pretrained)") from None


def _causal_lm_config(folder: Path, key: str):
    """The config of a folder whose model is a causal LM (``is_causal_lm_class``), not a critic or
    reward model saved with a head of its own."""
    config = _model_config(folder, key)
    architectures = config.architectures or []
    if architectures and not any(is_causal_lm_class(name) for name in architectures):
        raise UserError(
            f"{key}: '{folder}' holds a {architectures[0]}, not a causal language model (...ForCausalLM)"
        )
    return config


def read_generation_config(folder: Path, key: str) -> GenerationConfig | None:
    """The folder's ``generation_config.json`` (None without one), read alike by one process and by ranks.

    ``from_pretrained`` falls back to the model config's defaults without a word when the file
    is not JSON, and blames the weights when a value is invalid; reading it first, on its own,
    refuses it in both cases with the file named.
    """
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    what, fix = f"{key}: the generation config", ("fix the file (GenerationConfig.from_pretrained must read it), or "
                                                  "remove it to use the model config's defaults")
    with reading(path, what, fix):  # JSON's own message first: it says where (line, column)
        raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise UserError(f"{what} '{path}' holds a {type(raw).__name__}, not a mapping of settings; {fix}")
    with reading(path, what, fix):  # then its values, as transformers validates them
        return GenerationConfig.from_pretrained(folder)


def load_causal_lm(
    path: str, *, key: str, device: torch.device, gradient_checkpointing: bool = False
) -> PreTrainedModel:
    """An ``AutoModelForCausalLM`` in fp32 on ``device`` (actor or reference)."""
    folder = check_model_folder(path, key)
    _causal_lm_config(folder, key)
    read_generation_config(folder, key)  # before from_pretrained, which would misreport or skip a bad one
    model = _from_pretrained(AutoModelForCausalLM, folder, key, dtype=torch.float32)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.config.use_cache = False
    return model.to(device)


def load_critic(
    path: str, *, key: str, device: torch.device, gradient_checkpointing: bool = False, seed: int = 0
) -> PreTrainedModel:
    """A value model: the backbone of ``path`` with a one-output token head (initialised from ``seed``).

    A folder that already is a token-classification model with one label (a saved critic)
    loads as it is.
    """
    folder = check_model_folder(path, key)
    config = _model_config(folder, key)
    config.num_labels = 1
    # The head must be deterministic: no dropout in front of the value projection.
    config.classifier_dropout = 0.0
    with seeded(seed, device):  # the head's initialisation; the run's own streams go on untouched
        critic = _from_pretrained(AutoModelForTokenClassification, folder, key, config=config, dtype=torch.float32)
    if gradient_checkpointing:
        enable_activation_checkpointing(critic)
    critic.config.use_cache = False
    return critic.to(device)


def check_same_tokenizer(reference: PreTrainedTokenizerBase, path: str, key: str, actor_path: str | None = None) -> None:
    """A model scoring the actor's token ids must share the actor's vocabulary (the actor's own folder does,
    wherever its tokenizer was read from)."""
    if Path(path).resolve() in {Path(p).resolve() for p in (reference.name_or_path, actor_path) if p}:
        return
    other = load_tokenizer(path, key)
    if other.get_vocab() != reference.get_vocab():
        raise UserError(
            f"{key}: the tokenizer in '{path}' differs from the actor's ({len(other)} vs {len(reference)} tokens); "
            "it would read the actor's token ids as other words: use a model trained with the actor's tokenizer"
        )


def first_eos_id(config) -> int | None:
    """The model config's EOS id, the first where it lists several (config.json's ``eos_token_id``
    may: Llama-3.1-Instruct's has three), as a pad id must be one id."""
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) and eos else eos


def load_reward_model(
    path: str, *, key: str, device: torch.device, gradient_checkpointing: bool = False, seed: int = 0
) -> PreTrainedModel:
    """A one-output ``AutoModelForSequenceClassification``: a trained reward model, or (to train
    one) a causal LM's backbone with a fresh score head initialised from ``seed``."""
    folder = check_model_folder(path, key)
    config = _model_config(folder, key)
    config.num_labels = 1
    with seeded(seed, device):
        model = _from_pretrained(AutoModelForSequenceClassification, folder, key, config=config, dtype=torch.float32)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = first_eos_id(model.config)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.config.use_cache = False
    return model.to(device)


def check_trained_score_head(path: str, key: str) -> None:
    """Refuse a folder whose reward model's score head would be new: a model that scores PPO's
    responses must bring its trained head.

    ``load_reward_model`` (and the sharded load) initialise a head the folder lacks, which is
    right for ``klppo rm``, which trains one; scoring with it would give random rewards. The
    check reads only the config and the weights' names, and is the same on one process and on
    ranks.
    """
    from klppo.models.sharded_load import WeightReader, empty_model

    folder = check_model_folder(path, key)
    check_weight_files(folder, key)
    model = empty_model(AutoModelForSequenceClassification, _reward_model_config(folder, key))
    backbone, reader = f"{model.base_model_prefix}.", WeightReader(folder, key)
    missing = [name for name, _ in model.named_parameters() if not name.startswith(backbone) and name not in reader]
    if missing:
        held = ", ".join(model.config.architectures or []) or "a model"
        raise UserError(f"{key}: '{folder}' holds {held} with no trained score head ('{missing[0]}' is not in its "
                        "weights), so its rewards would come from a randomly initialised layer; point it at a reward "
                        "model (klppo rm trains one from this folder)")


# ---- empty models for sharded loading (klppo.models.sharded_load) ----


def _critic_config(folder: Path, key: str):
    config = _model_config(folder, key)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the head must be deterministic: no dropout in front of the value projection
    return config


def _reward_model_config(folder: Path, key: str):
    config = _model_config(folder, key)
    config.num_labels = 1
    return config


# role -> (auto class, config builder, whether a new head may be initialised)
ROLES = {
    "causal_lm": (AutoModelForCausalLM, _causal_lm_config, False),
    "critic": (AutoModelForTokenClassification, _critic_config, True),
    "reward_model": (AutoModelForSequenceClassification, _reward_model_config, True),
}


def empty_model_for(role: str, path: str, *, key: str, gradient_checkpointing: bool = False) -> PreTrainedModel:
    """The model ``load_causal_lm`` / ``load_critic`` / ``load_reward_model`` would load from ``path``,
    with its parameters on the meta device, to be sharded and then filled
    (``klppo.models.sharded_load``). The folder is checked as those loaders check it."""
    from klppo.models.sharded_load import empty_model

    auto_class, make_config, _ = ROLES[role]
    folder = check_model_folder(path, key)
    check_weight_files(folder, key)
    model = empty_model(auto_class, make_config(folder, key))
    check_weight_shapes(model, folder, key)
    generation = read_generation_config(folder, key) if role == "causal_lm" else None
    if generation is not None:
        model.generation_config = generation
    if role == "reward_model" and model.config.pad_token_id is None:
        model.config.pad_token_id = first_eos_id(model.config)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.config.use_cache = False
    return model
