"""The staged LLaMA-style decoder, route execution and the cost-model partitioner."""

from .partition import Partition, best_partition, partition_layers
from .transformer import StagedLM

__all__ = ["Partition", "StagedLM", "best_partition", "partition_layers"]
