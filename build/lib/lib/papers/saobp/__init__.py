"""Paper B, "Mitigating Attention Localization in Small Scale: Self-Attention Refinement via One-step Belief
Propagation" (SAOBP; notebooks 07-10), by step:

* :mod:`~lib.papers.saobp.refinement`: our reconstruction of the one-step belief-propagation refinement, Global
  Token Dependency (GTD) and the attention statistics (entropy by depth, the sink);
* :mod:`~lib.papers.saobp.scratch`: small models trained from scratch, their tasks, the training loop, the
  cached runs and fine-tunes (measurement records), and the search for a setting whose attention collapses.

The names below are the refinement's (``from lib.papers import saobp``; ``saobp.attach(lm, J)``); the from-scratch
runs are ``from lib.papers.saobp import scratch``.
"""
from lib.papers.saobp.refinement import (COLLAPSE_THRESHOLD, DEFAULT_J, J_MODES, SAOBP, AttentionStats, active, attach, attention_stats,
                                         batches, depth_fall, detach, get, gtd_2hop, gtd_msg, initial_theta, messages,
                                         no_cache, query_mask, thirds, trim, without_sink)

__all__ = ["COLLAPSE_THRESHOLD", "DEFAULT_J", "J_MODES", "SAOBP", "AttentionStats", "active", "attach", "attention_stats", "batches",
           "depth_fall", "detach", "get", "gtd_2hop", "gtd_msg", "initial_theta", "messages", "no_cache", "query_mask",
           "thirds", "trim", "without_sink"]
