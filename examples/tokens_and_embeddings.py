"""Token sequences and embeddings, with a random augmentation that survives a resume.

Run it::

    python examples/tokens_and_embeddings.py --lake /tmp/token-lake --workers 2

It writes a lake (if missing) with a 64-dim ``embedding`` (``fixed_size_list<float32>[64]``)
and ``tokens`` (``list<int32>``, 8 to 96 ids), then trains a tiny bag-of-tokens model on it.
Each batch arrives as ``embedding`` ``[B, 64]`` and ``tokens`` as a jagged nested tensor; a
``batch_transform`` (run in the workers) masks 15 % of each row's tokens with draws from the
row's own generator (``lakeloader.row_rngs()``), so the mask of a row does not depend on the
worker count, the batch size or a resume. The script stops half-way through the epoch, saves
the loader's state, resumes it with another worker count and batch size, and checks that every
row was trained on once, with the same mask it would have had without the interruption.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import lakeloader as ll

MASK_ID = 0
DIM = 64
logger = logging.getLogger("tokens_and_embeddings")


def make_lake(root: Path, files: int = 4, rows: int = 2_000) -> None:
    """Write ``files`` Parquet files of ``rows`` rows (ids, embeddings, token lists)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        lengths = rng.integers(8, 97, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(rng.integers(1, 1000, offsets[-1]).astype(np.int32))
        )
        embedding = pa.FixedSizeListArray.from_arrays(
            pa.array(rng.normal(size=rows * DIM).astype(np.float32)), DIM
        )
        ids = np.arange(f * rows, (f + 1) * rows)
        table = pa.table({"id": ids, "embedding": embedding, "tokens": tokens})
        pq.write_table(table, root / f"part-{f:03d}.parquet", row_group_size=500)


def mask_tokens(batch: dict[str, Any]) -> dict[str, Any]:
    """Mask 15 % of each row's tokens, drawing from the row's own generator."""
    tokens = batch["tokens"]
    values, offsets = tokens.values().clone(), tokens.offsets()
    bounds = zip(ll.row_rngs(), offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    for rng, start, stop in bounds:
        values[start:stop][torch.from_numpy(rng.random(stop - start) < 0.15)] = MASK_ID
    masked = torch.nested.nested_tensor_from_jagged(values, offsets)
    return {"id": batch["id"], "embedding": batch["embedding"], "tokens": masked}


class BagOfTokens(torch.nn.Module):
    """Predicts a row's mean embedding coordinate from its (masked) tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(1000, 16, mode="mean")
        self.head = torch.nn.Linear(16, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat, offsets = tokens.values().long(), tokens.offsets()[:-1]
        return self.head(self.embed(flat, offsets)).squeeze(1)


def train(loader: ll.DataLoader, model: BagOfTokens, stop: int | None, seen: dict) -> None:
    """Train until the epoch ends or ``stop`` steps; record each row's masked token count."""
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, batch in enumerate(loader):
        target = batch["embedding"].mean(dim=1)
        loss = torch.nn.functional.mse_loss(model(batch["tokens"]), target)
        optim.zero_grad()
        loss.backward()
        optim.step()
        for i, row in zip(batch["id"].tolist(), batch["tokens"].unbind(), strict=True):
            assert i not in seen, f"row {i} trained on twice"
            seen[i] = int((row == MASK_ID).sum())
        if stop is not None and step + 1 == stop:
            return


def main() -> None:
    """Train half an epoch, resume on another topology, and check the masks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake", type=Path, default=Path("/tmp/lakeloader-token-lake"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.lake.exists():
        make_lake(args.lake)
    dataset = ll.LakeDataset(args.lake, seed=1, batch_transform=mask_tokens)
    model, seen = BagOfTokens(), {}

    first = ll.DataLoader(dataset, batch_size=64, num_workers=args.workers)
    train(first, model, stop=len(first) // 2, seen=seen)
    state = first.state_dict()
    first.close()
    resumed = ll.DataLoader(dataset, batch_size=48, num_workers=0 if args.workers else 2)
    resumed.load_state_dict(state)
    train(resumed, model, stop=None, seen=seen)
    resumed.close()

    again: dict[int, int] = {}
    train(
        ll.DataLoader(dataset, batch_size=100, num_workers=args.workers), BagOfTokens(), None, again
    )
    assert len(seen) == len(dataset), (len(seen), len(dataset))
    assert seen == again, "a row's mask changed with the topology or the resume"
    logger.info(
        "trained on all %d rows once across a resume (%d -> %d workers, batch 64 -> 48); "
        "every row's mask is the one an uninterrupted run at batch 100 draws",
        len(seen),
        args.workers,
        0 if args.workers else 2,
    )


if __name__ == "__main__":
    main()
