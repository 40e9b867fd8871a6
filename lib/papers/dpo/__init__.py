"""Paper A, "How Does DPO Reduce Toxicity? A Mechanistic Neuron-Level Analysis" (notebooks 01-06), by step:

* :mod:`~lib.papers.dpo.probe`: the linear toxicity probe (logistic regression on the pooled final residual
  stream; its direction is ``coef_``, bias dropped);
* :mod:`~lib.papers.dpo.pairs`: preference pairs (neutral Wikipedia prompts; preferred = greedy continuation,
  dispreferred = continuation steered along the probe data's class-mean difference, kept when more toxic);
* :mod:`~lib.papers.dpo.training`: DPO with TRL's ``DPOTrainer`` (sigmoid loss, beta 0.1), cached;
* :mod:`~lib.papers.dpo.evaluation`: toxicity, perplexity and F1 (the Lee et al. 2024 protocol), edited or not;
* :mod:`~lib.papers.dpo.gate`: the direction gate that 03-06's preconditions read;
* :mod:`~lib.papers.dpo.neurons`: per-neuron statistics, the four groups, patching and editing tables;
* :mod:`~lib.papers.dpo.sizes` and :mod:`~lib.papers.dpo.shared_setup`: the sizes and the one setup call of 02-06;
* :mod:`~lib.papers.dpo.records`: what the audit compares for each of the steps' measurement records.

Every builder caches its result (:mod:`lib.infra.cache`) or reads its measurement record (:mod:`lib.infra.store`), so a later
notebook reuses what an earlier one built and every notebook still runs alone. The names below are the ones the
notebooks use (``from lib.papers import dpo``; ``dpo.setup(...)``).
"""
from lib.papers.dpo import records  # noqa: F401  (declares the steps' records and their audit comparisons)
from lib.papers.dpo.evaluation import (PATCH_POSITIONS, dpo_lowered_toxicity, evaluate, evaluate_each, evaluation_inputs, prompt_sets,
                                       read_prompts, rescored, shared_prefixes, toxicity_perplexity_f1)
from lib.papers.dpo.gate import (DIRECTIONS, FRIENDLY_WORD_POOL, GATE, GATE_MODES, MIN_WHOLE_WORDS, NORMS_OF, SWEEP,
                                 TOXIC_WORD_POOL, DirectionGate, candidate_directions, neuron_token_toxicity,
                                 single_token_words, sweep_directions, top_aligned, validate_directions,
                                 whole_word_direction)
from lib.papers.dpo.neurons import random_neurons
from lib.papers.dpo.pairs import preference_pairs, shuffled_pairs, steered_generate, steering_vector
from lib.papers.dpo.probe import (NONTOXIC_WORDS, PROBE_FEATURE_LAYER, TOXIC_WORDS, Probe, features, fit_probe,
                                  probe_classifier, probe_data, probe_states, steer_layer, train_probe)
from lib.papers.dpo.shared_setup import Setup, setup
from lib.papers.dpo.sizes import TRAINING_KEYS, Sizes
from lib.papers.dpo.training import HALFWAY, DPORun, base_and_dpo, dpo_halfway, dpo_run, train_dpo

__all__ = ["PATCH_POSITIONS", "dpo_lowered_toxicity", "evaluate", "evaluate_each", "evaluation_inputs", "prompt_sets", "read_prompts",
           "rescored", "shared_prefixes", "toxicity_perplexity_f1", "DIRECTIONS", "FRIENDLY_WORD_POOL", "GATE",
           "GATE_MODES", "MIN_WHOLE_WORDS", "NORMS_OF", "SWEEP", "sweep_directions", "TOXIC_WORD_POOL", "DirectionGate", "candidate_directions",
           "neuron_token_toxicity", "single_token_words", "top_aligned", "validate_directions",
           "whole_word_direction", "random_neurons", "preference_pairs", "shuffled_pairs", "steered_generate", "steering_vector", "NONTOXIC_WORDS",
           "PROBE_FEATURE_LAYER", "TOXIC_WORDS", "Probe", "features", "fit_probe", "probe_classifier", "probe_data",
           "probe_states", "steer_layer", "train_probe", "Setup", "setup", "TRAINING_KEYS", "Sizes", "HALFWAY",
           "DPORun", "base_and_dpo", "dpo_halfway", "dpo_run", "train_dpo"]
