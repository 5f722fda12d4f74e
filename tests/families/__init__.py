"""Decoder families declared outside jaxattn, on its public decoder API only (``jaxattn.decoder``,
``jaxattn.models``, ``jaxattn.checkpoint`` and the package's own names): each module is a model module of
the protocol (:mod:`jaxattn.models`), exercised by tests/test_decoder_families.py."""
