"""The data set the swarm benches train on: the tests' byte-level excerpts (Hamlet and Macbeth,
Milton as the out-of-distribution split), written into a bench's working directory."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def excerpt_data(root: Path) -> Path:
    """``root/data``: the excerpts, byte tokenizer, 10% validation."""
    from skiptrain.data.corpus import read_documents
    from skiptrain.data.dataset import write_dataset

    texts = REPO / "tests" / "data"
    data = root / "data"
    write_dataset(data, read_documents([str(texts / "hamlet_excerpt.txt"), str(texts / "macbeth_excerpt.txt")]),
                  read_documents([str(texts / "milton_excerpt.txt")]), tokenizer="byte", val_fraction=0.1,
                  source="test excerpts")
    return data
