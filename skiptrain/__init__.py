"""skiptrain: training transformer language models across far-apart, unequal, unreliable machines.

Folders: ``model`` (staged LLaMA decoder, partitioner), ``data`` (corpus, tokenizer, loader),
``train`` (single-process trainer), ``schedule`` (placement, routes, simulator), ``net``
(topologies, links), ``runtime`` (node processes), ``dp`` (data-parallel sync strategies),
``elastic`` (freezing), ``checkpoint`` (reshardable checkpoints).
"""

__version__ = "0.1.0"
