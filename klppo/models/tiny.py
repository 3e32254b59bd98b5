"""The built-in tiny model and tokenizer: made here, from a config and a local corpus.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on the caller's texts, with
digits split one per token (so arithmetic is learnable by a small model) and a ChatML chat
template, so it behaves like the tokenizers of real instruction models. The model is a
Qwen2-shaped causal LM with random initialisation, saved as an ordinary Hugging Face folder
that ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from klppo.models.rng import seeded

PAD, EOS, IM_START = "<|pad|>", "<|im_end|>", "<|im_start|>"

# ChatML, as Qwen2 instruct models write it; `add_generation_prompt` opens the assistant turn. Tools
# are shown as Qwen shows them: their schemas, one JSON per line, in a system turn before the messages.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}{{ '</tools><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 384, chat_template: bool = True
                         ) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``; any string round-trips through it.

    ``chat_template=False`` leaves the template out, as a base model's tokenizer has none.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
) -> Qwen2Config:
    """A Qwen2-shaped config small enough to train on a laptop CPU in minutes."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )


def build_tiny_model_folder(
    out_dir: str | Path, texts: Iterable[str], *, seed: int = 0, vocab_size: int = 384, chat_template: bool = True,
    **config_kwargs
) -> Path:
    """Train a tokenizer on ``texts``, build a random-init tiny Qwen2 model, save both to ``out_dir``.

    Returns ``out_dir``, a folder that ``AutoTokenizer`` and ``AutoModelForCausalLM`` load.
    ``chat_template=False`` makes a base model: its tokenizer has no chat template.
    """
    out = Path(out_dir)
    tokenizer = train_tiny_tokenizer(texts, vocab_size=vocab_size, chat_template=chat_template)
    config = tiny_model_config(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_kwargs,
    )
    # The caller's random streams (CPU and CUDA) stay untouched by model initialisation.
    with seeded(seed, torch.device("cpu")):
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save ``tokenizer`` so that it reloads with exactly its own entries, one per embedding row.

    The folder's config.json says qwen2, so ``AutoTokenizer`` reloads it as ``Qwen2Tokenizer``,
    whose unk token defaults to ``<|endoftext|>``: a tokenizer saved without an unk token comes
    back with that token added past the last trained id, one id more than the model has rows,
    and a prompt containing the text indexes past the embedding. Released Qwen2 tokenizers
    write ``"unk_token": null`` for this reason (a byte-level BPE has no unknown input); so
    does this one.
    """
    tokenizer.save_pretrained(out)
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.setdefault("unk_token", None)
    path.write_text(json.dumps(config, indent=2) + "\n")
