"""Choices of the graph layer (no torch import: the config schema imports them from here)."""

from __future__ import annotations

import enum


class NegativeSampling(enum.Enum):
    """How negative destinations are drawn for link prediction."""

    UNIFORM = "uniform"  # every node alike
    DEGREE = "degree"  # proportional to degree ** 0.75 (word2vec's unigram ** 0.75)
