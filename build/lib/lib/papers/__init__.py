"""Each paper's own code, one package per paper; a paper imports the shared core (``lib``) and never another paper.

* :mod:`lib.papers.dpo`: paper A, "How Does DPO Reduce Toxicity? A Mechanistic Neuron-Level Analysis";
* :mod:`lib.papers.saobp`: paper B, "Mitigating Attention Localization in Small Scale: Self-Attention Refinement
  via One-step Belief Propagation";
* :mod:`lib.papers.relations`: paper C, "On Relation-Specific Neurons in Large Language Models".
"""
