"""Paper C, relation-specific neurons ("On Relation-Specific Neurons in Large Language Models", EMNLP 2025,
which builds on Kojima et al.'s expert-neuron code, apple/ml-selfcond). Intervals and tests: :mod:`lib.stats`.

One call, :func:`setup`, returns a :class:`Study`: the model, the selected relations and their
splits, every unit's AvgPrec and the cached test runs. Under the paper's protocol (the default,
:data:`PROTOCOLS`):

* facts come from LRE (:func:`lre_facts`), KLAR (:func:`klar_facts`) or a user JSONL file
  (:func:`read_facts`); prompts are zero-shot, the answer is 2 greedy tokens, correct when the
  shorter of continuation and gold object is a prefix of the other (:func:`matches`); :func:`answer` runs one batched prefill with
  last-position logits and KV-cached steps, and can record every unit's mean response on the way;
* units are the outputs of up, gate and down in every layer (:class:`~lib.papers.relations.units.Units`); a unit's
  response to a prompt is its mean over the prompt's tokens;
* a relation is selected when the model answers at least ``min_correct`` identification prompts;
  those are its positives, with ``neg_ratio`` times as many negatives from the other relations;
* a unit's score is its average precision, ties broken by the standardised difference of mean
  responses (never by position); the top k (the paper's 3,000 of 835,584, as a fraction) are the
  relation's units; switching them off sets them to 0 at every position (:func:`~lib.papers.relations.units.zero_units`);
* controls are random units of the same size drawn per site and layer (:func:`random_units`).

``protocol="ours"`` keeps the earlier variant (3-shot prompts, 4 tokens, the act(gate)*up site only,
k = 200 of 46,080, "starts with" as the rule). Every function works for any decoder
:class:`~lib.models.Loaded` (GPT-2, Llama, Gemma-2, Mistral).
By step: :mod:`~lib.papers.relations.facts` (relations, loaders, splits), :mod:`~lib.papers.relations.answers`
(protocols, the answer rule, the batched pass), :mod:`~lib.papers.relations.units` (the up, gate and down units), :mod:`~lib.papers.relations.study` (sizes, selection, AvgPrec,
top and random units, :func:`setup`), :mod:`~lib.papers.relations.analyses` (attribution, token parts, KLAR) and
:mod:`~lib.papers.relations.records` (what the audit compares). The names below are the ones the notebooks use
(``from lib.papers import relations``).
"""
from lib.papers.relations import records  # noqa: F401  (declares the steps' records and their audit comparisons)
from lib.papers.relations.analyses import TOKEN_PARTS, ap_by_tokens, attribution, klar_aligned_tests
from lib.papers.relations.answers import PROTOCOLS, RULES, Answers, Protocol, answer, matches, measured_answers
from lib.papers.relations.facts import (FACT_FIELDS, Relation, TestSet, gold_first_token, klar_facts, lre_facts,
                                        read_facts, split_by_id)
from lib.papers.relations.units import SITE_POINTS, SITES, UnitRecorder, Units, zero_units
from lib.papers.relations.study import (TEMPLATE_MODES, Sizes, Study, item_values, random_units, score_many, setup,
                                        top_of)

__all__ = ["TOKEN_PARTS", "ap_by_tokens", "attribution", "klar_aligned_tests", "PROTOCOLS", "RULES", "Answers",
           "Protocol", "answer", "matches", "measured_answers", "FACT_FIELDS", "Relation", "TestSet",
           "gold_first_token", "klar_facts", "lre_facts", "read_facts", "split_by_id", "TEMPLATE_MODES", "Sizes",
           "Study", "item_values", "random_units", "score_many", "setup", "top_of", "SITE_POINTS", "SITES", "UnitRecorder", "Units", "zero_units"]
