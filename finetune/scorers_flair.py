"""Moved to :mod:`finetune.scorers.flair` (issue 25); this name keeps old imports working."""

from finetune.scorers.flair import *  # noqa: F401,F403
from finetune.scorers.flair import (  # noqa: F401
    FlairGlobalScorer,
    FlairScorer,
    candidate_scores,
    conditioned_scores,
    public_code_scores,
)
