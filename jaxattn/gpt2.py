"""GPT-2 in pure JAX on jaxattn's own attention: load real weights, get every attention map as data.

    params, config, tokenizer = jaxattn.gpt2.load("gpt2")        # or a local checkpoint directory
    ids = tokenizer.encode("The trophy didn't fit in the suitcase because it was too big.")
    out = jaxattn.gpt2.forward(params, config, ids)               # out.logits [T, V]
    out.attentions                                                # [L, N, T, T]
    jaxattn.gpt2.forward(params, config, ids, scale=1.0)          # the same weights without the √d_k

Axis alphabet: T tokens, N heads, H head dim (d_k), D width, V vocabulary, L layers.
"""

from jaxattn._checkpoint import CheckpointError, TextTokenizer
from jaxattn._gpt2 import (
    GPT2Config,
    GPT2Output,
    check_params,
    forward,
    init_params,
    lab_model,
    load,
    log_prob,
    param_shapes,
    params_from_msgpack,
    SIZES,
    params_from_safetensors,
    random_model,
    read_gpt2_config,
    save,
)

__all__ = [
    "CheckpointError",
    "GPT2Config",
    "GPT2Output",
    "TextTokenizer",
    "check_params",
    "forward",
    "init_params",
    "lab_model",
    "load",
    "log_prob",
    "param_shapes",
    "params_from_msgpack",
    "params_from_safetensors",
    "random_model",
    "read_gpt2_config",
    "SIZES",
    "save",
]
