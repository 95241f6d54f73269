"""OOM recovery (Magnus): split a batch that ran out of memory into two halves of equal size."""

from __future__ import annotations

from cohort.types import Batch, new_id


class UnsplittableBatch(Exception):
    """A batch of one ran out of memory: the request cannot fit on this instance."""


def split_batch(batch: Batch) -> tuple[Batch, Batch]:
    """Two halves in the original order (first half gets the extra member when β is odd).

    A batch of one cannot be split: the caller fails that request with a clear error instead
    of looping.
    """
    if batch.size < 2:
        raise UnsplittableBatch(
            f"batch {batch.id}: a single request needs more KV memory than the instance has"
        )
    mid = (batch.size + 1) // 2
    halves = []
    for part in (batch.requests[:mid], batch.requests[mid:]):
        halves.append(Batch(id=new_id("b"), requests=list(part), created=batch.created,
                            attempt=batch.attempt, splits=batch.splits + 1))
    return halves[0], halves[1]
