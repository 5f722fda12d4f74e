"""A pretrained BERT-family encoder that works offline: all-MiniLM-L6-v2 on jaxattn's own attention.

```python
from jaxattn import bert

params, config, tokenizer = bert.load()          # the bundled all-MiniLM-L6-v2 (no PyTorch, no network)
batch = bert.tokenize(tokenizer, "The trophy didn't fit in the suitcase because it was too big.")
out = bert.forward(params, config, batch["input_ids"][0], attention_mask=batch["attention_mask"][0])
out.last_hidden_state   # [T, D]
out.attentions          # [L, N, T, T], every layer's and head's softmax weights
bert.embed(params, config, tokenizer, ["a sentence", "another"])  # [B, D], unit-norm sentence embeddings
trophy.compare(bert.lab_model())  # the lab's part 4 on the encoder (see jaxattn.trophy)
```

``CheckpointError`` is the package's one checkpoint error (:mod:`jaxattn._checkpoint`), shared with GPT-2.

See :mod:`jaxattn._bert` for the params layout and the axis alphabet.
"""

from jaxattn._bert import (
    BUNDLED_NAME,
    BertConfig,
    BertOutput,
    CheckpointError,
    bundled_model_dir,
    embed,
    forward,
    lab_model,
    load,
    mean_pool,
    normalize,
    tokenize,
)

__all__ = [
    "BUNDLED_NAME",
    "BertConfig",
    "BertOutput",
    "CheckpointError",
    "bundled_model_dir",
    "embed",
    "forward",
    "lab_model",
    "load",
    "mean_pool",
    "normalize",
    "tokenize",
]
