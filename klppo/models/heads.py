"""The classes a critic and a reward model are built with, for every causal LM type transformers
ships a backbone of (``model_class``)."""

from __future__ import annotations

import functools

from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification, PreTrainedModel
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification


def _mapped(auto_class, config_class: type):
    """The auto class's model class for ``config_class``, or None. (Its mapping's ``in`` misses a config
    class that several model types share, as Gemma 3's text config is: only a lookup finds it.)"""
    try:
        return auto_class._model_mapping[config_class]
    except KeyError:
        return None


def is_causal_lm_class(name: str) -> bool:
    """Whether a Hugging Face class name is a causal LM's: a ``...ForCausalLM``, or one of the classes
    ``AutoModelForCausalLM`` builds under another name (GPT-2's ``GPT2LMHeadModel``, Gemma 3's
    ``Gemma3ForConditionalGeneration``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return name.endswith("ForCausalLM") or name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


# The one-output heads of a critic and a reward model: the auto class, transformers' generic head, the class name's end.
_HEADS = {AutoModelForTokenClassification: (GenericForTokenClassification, "ForTokenClassification"),
          AutoModelForSequenceClassification: (GenericForSequenceClassification, "ForSequenceClassification")}


def model_class(auto_class, config_class: type):
    """What builds ``auto_class``'s model for a config of ``config_class``: the auto class itself, or
    for a critic or reward model of a type transformers gives no such head, one made here.

    transformers 5.25 ships a token-classification class (the critic's) for 60 of its 200 causal
    LM types and a sequence-classification one (the reward model's) for 86: Gemma 3, OLMo 1-3,
    Phi-MoE and DeepSeek-V2 lack the first, Granite, Cohere 1-2, ERNIE 4.5 and LFM2 both. Its own
    heads of the others are one composition, ``class LlamaForTokenClassification(
    GenericForTokenClassification, LlamaPreTrainedModel)``: the generic head on the type's
    backbone (``AutoModel``) and the type's pre-trained base (weight initialisation, the blocks
    FSDP2 wraps, the backbone's name in the weights). The missing ones are composed the same way,
    of transformers' classes only; a type with no backbone class gets the auto class, which
    refuses it. (Registering them with the auto class would reach fewer versions: 5.17 ignores
    a registration for a config class of transformers.)
    """
    if auto_class not in _HEADS or _mapped(auto_class, config_class) is not None:
        return auto_class
    return _composed_head(auto_class, config_class)


@functools.cache
def _composed_head(auto_class, config_class: type):
    backbone = _mapped(AutoModel, config_class)
    if backbone is None:
        return auto_class
    base = next((c for c in backbone.__mro__[1:] if issubclass(c, PreTrainedModel) and c is not PreTrainedModel),
                backbone)
    generic, suffix = _HEADS[auto_class]
    return type(backbone.__name__.removesuffix("Model") + suffix, (generic, base),
                {"config_class": config_class, "base_model_prefix": base.base_model_prefix, "__module__": __name__})
