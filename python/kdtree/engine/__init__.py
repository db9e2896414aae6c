"""The decoding engine: the DDTree round loop (:mod:`~kdtree.engine.rounds`), the
Hugging Face target (:mod:`~kdtree.engine.hf`), the DFlash-style block drafter
(:mod:`~kdtree.engine.drafter`) and the byte n-gram pair (:mod:`~kdtree.engine.ngram`).

The round loop needs only numpy and the core; the target and drafter modules need torch
and transformers and are imported on use.
"""

from .rounds import (
    STAGES,
    Drafter,
    GenerationResult,
    RoundSnapshot,
    Target,
    autoregressive_generate,
    speculative_generate,
)

__all__ = [
    "STAGES",
    "Drafter",
    "GenerationResult",
    "RoundSnapshot",
    "Target",
    "autoregressive_generate",
    "speculative_generate",
]
