"""The lab's parts 3-4 on any model: the trophy sentence's attention maps, and "too big" vs "too small".

    model = jaxattn.gpt2.lab_model(*jaxattn.gpt2.load("gpt2"))
    maps = jaxattn.trophy.sentence_maps(model, jaxattn.trophy.SENTENCES["big"])
    part3 = jaxattn.trophy.render_part3(maps, layer=5, head=1)      # text; experiments/trophy.py prints it
    part4 = jaxattn.trophy.render_part4(jaxattn.trophy.compare(model))

A model plugs in through :class:`LabModel` (name, causal flag, tokenize, attentions, optional scorer).
"""

from jaxattn._trophy import (
    LEVELS,
    RESOLUTION_PROMPT,
    RESOLUTIONS,
    SENTENCES,
    Comparison,
    LabModel,
    SentenceMaps,
    compare,
    focus_head,
    png_grid,
    render_ascii,
    render_part3,
    render_part4,
    sentence_maps,
    word_span,
)

__all__ = [
    "LEVELS",
    "RESOLUTION_PROMPT",
    "RESOLUTIONS",
    "SENTENCES",
    "Comparison",
    "LabModel",
    "SentenceMaps",
    "compare",
    "focus_head",
    "png_grid",
    "render_ascii",
    "render_part3",
    "render_part4",
    "sentence_maps",
    "word_span",
]
