"""The language model a configuration names (``model.cell``): the recurrent
:class:`rnnlm.core.model.RNNLM` or the feed-forward :class:`rnnlm.core.ffnn.FFNNLM`,
built here so that neither model's module imports the other."""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from .ffnn import FFNNLM
from .model import RNNLM


def build(cfg: ModelConfig, xp=np, dtype: str | None = None):
    """The model ``cfg.cell`` names: :class:`RNNLM` or the feed-forward :class:`FFNNLM`."""
    if cfg.cell == "ffnn":
        return FFNNLM(cfg, xp=xp, dtype=dtype)
    return RNNLM(cfg, xp=xp, dtype=dtype)
