"""The checkpointable loader: this process's slice of each global batch, in OLMo-core's order.

The loader's position is one number of batches handed out (`step`, from which
epoch and batch-in-epoch follow); a batch is a pure function of
(dataset, seed, step, global batch, process index and count), so resuming is
setting the position, never replaying, and no slice is re-sharded downstream.
Prefetch threads compute batches ahead of the position but never move it:
`state_dict()` after the trainer took batch N says "next is batch N + 1".
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from olmax.data.filters import repetition_keep
from olmax.data.mixture import mixture_facts, select_mixture
from olmax.data.order import batches_per_epoch, epoch_order, local_rows
from olmax.data.shards import DataError, TokenShards, describe_change, resolve_sources

log = logging.getLogger(__name__)


class BatchReader:
    """step -> this process's slice of global batch `step` (epochs follow one another)."""

    def __init__(
        self,
        shards: TokenShards,
        *,
        seed: int,
        global_batch_instances: int,
        process_index: int,
        process_count: int,
        repetition_filter: dict | None,
    ):
        self.shards = shards
        self.seed = seed
        self.global_batch_instances = global_batch_instances
        self.process_index = process_index
        self.process_count = process_count
        self.repetition_filter = repetition_filter
        self.batches_per_epoch = batches_per_epoch(shards.num_instances, global_batch_instances)
        self._rows: dict[int, np.ndarray] = {}
        self._rows_lock = threading.Lock()

    def rows(self, epoch: int) -> np.ndarray:
        """This process's instance ids of every batch of the epoch, [batches, local batch]."""
        with self._rows_lock:
            if epoch not in self._rows:
                order = epoch_order(self.shards.num_instances, self.seed, epoch)
                # Keep the previous epoch too: prefetch threads may straddle the boundary.
                self._rows = {e: r for e, r in self._rows.items() if e == epoch - 1}
                self._rows[epoch] = local_rows(
                    order, self.global_batch_instances, self.process_index, self.process_count
                )
            return self._rows[epoch]

    def read(self, step: int) -> dict[str, np.ndarray]:
        epoch, batch = divmod(step, self.batches_per_epoch)
        instances = self.rows(epoch + 1)[batch]
        input_ids = self.shards.read(instances)
        if self.repetition_filter is None:
            instance_mask = np.ones(len(input_ids), dtype=bool)
        else:
            instance_mask = repetition_keep(input_ids, **self.repetition_filter)
        return {"input_ids": input_ids, "instance_mask": instance_mask}


class Loader:
    """Iterator of batches {"input_ids": int32 [B/P, L], "instance_mask": bool [B/P]} over epochs."""

    def __init__(self, reader: BatchReader, *, num_workers: int = 0, allow_fingerprint_change: bool = False):
        self.reader = reader
        self.allow_fingerprint_change = allow_fingerprint_change
        # Batches handed out over all epochs: the model's step while the global batch size never changed.
        self.step = 0
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="olmax-data") if num_workers else None
        self._depth = 2 * num_workers
        self._pending: deque[tuple[int, Future]] = deque()

    @property
    def fingerprint(self) -> str:
        return self.reader.shards.fingerprint

    @property
    def sequence_length(self) -> int:
        return self.reader.shards.sequence_length

    @property
    def global_batch_instances(self) -> int:
        return self.reader.global_batch_instances

    @property
    def batches_per_epoch(self) -> int:
        return self.reader.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.step // self.batches_per_epoch + 1

    @property
    def batches_processed(self) -> int:
        """Batches of the current epoch already handed out."""
        return self.step % self.batches_per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._pool is None:
            batch = self.reader.read(self.step)
        else:
            while len(self._pending) < self._depth:
                ahead = self._pending[-1][0] + 1 if self._pending else self.step
                self._pending.append((ahead, self._pool.submit(self.reader.read, ahead)))
            ahead, future = self._pending.popleft()
            assert ahead == self.step, (ahead, self.step)
            batch = future.result()
        self._advance()
        return batch

    def _advance(self) -> None:
        self.step += 1

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batches_processed": self.batches_processed,
            # Tokens of the current epoch, as OLMo-core: a new global batch size resumes at tokens // new batch.
            "tokens_processed": self.batches_processed * self.global_batch_instances * self.sequence_length,
            "seed": self.reader.seed,
            "fingerprint": self.fingerprint,
            "global_batch_instances": self.global_batch_instances,
            "sequence_length": self.sequence_length,
            "dataset": self.reader.shards.facts(),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"epoch", "tokens_processed", "seed", "fingerprint"} - set(state)
        if missing:
            raise DataError(f"the checkpoint's data state lacks {sorted(missing)}; it was not written by Loader.state_dict")
        saved = state.get("dataset")
        changes = describe_change(saved, self.reader.shards.facts()) if saved else []
        if state["fingerprint"] != self.fingerprint and not changes:
            changes = ["fingerprint"]
        if state["seed"] != self.reader.seed:
            changes.append(f"data.seed {state['seed']} -> {self.reader.seed}")
        if changes:
            what = "; ".join(changes)
            if not self.allow_fingerprint_change:
                raise DataError(
                    f"the data differs from the checkpoint's ({what}), so the run would not continue the same "
                    "data order; restore the checkpoint's data, or set data.allow_fingerprint_change=true to "
                    "continue with the new data at the same position"
                )
            log.warning("data changed since the checkpoint (%s); continuing as data.allow_fingerprint_change=true", what)
        tokens_per_batch = self.global_batch_instances * self.sequence_length
        batches = state["tokens_processed"] // tokens_per_batch
        if batches * tokens_per_batch != state["tokens_processed"]:
            log.warning(
                "resuming at batch %d of epoch %d: %d tokens processed is not a whole number of new global batches "
                "of %d tokens, so the rest of a batch is seen again (as OLMo-core)",
                batches, state["epoch"], state["tokens_processed"], tokens_per_batch,
            )
        # A smaller epoch (larger batch) ends where the old position was past its last whole batch.
        batches = min(batches, self.batches_per_epoch)
        self._drop_pending()
        self.step = (state["epoch"] - 1) * self.batches_per_epoch + batches

    def _drop_pending(self) -> None:
        for _, future in self._pending:
            future.cancel()
        for _, future in self._pending:
            if not future.cancelled():
                future.exception()
        self._pending.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._drop_pending()
            self._pool.shutdown(wait=True)
            self._pool = None
        self.reader.shards.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def build_loader(
    data,
    *,
    global_batch_instances: int,
    vocab_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Loader:
    """A loader for `data` (a DataConfig) reading only this process's columns of each global batch."""
    if not 0 <= process_index < process_count:
        raise DataError(f"process index {process_index} is outside [0, {process_count})")
    if global_batch_instances % process_count:
        raise DataError(
            f"train.global_batch_instances {global_batch_instances} is not divisible by the {process_count} "
            "processes; each process takes an equal slice: pick a multiple"
        )
    if data.sources:
        sources, instances = select_mixture(data, global_batch_instances=global_batch_instances)
        mixture = mixture_facts(data)
    else:
        sources = resolve_sources(data.paths, data.mix_file, data.mix_base_dir, data.mix_tokenizer)
        instances, mixture = None, None
    shards = TokenShards(
        sources,
        sequence_length=data.sequence_length,
        token_dtype=data.token_dtype,
        vocab_size=vocab_size,
        eos_id=data.eos_id,
        pad_id=data.pad_id,
        instances=instances,
        mixture=mixture,
    )
    if shards.num_instances < global_batch_instances:
        raise DataError(
            f"the mix has {shards.num_instances} instances of {data.sequence_length} tokens, fewer than one global "
            f"batch of {global_batch_instances}; add data or lower train.global_batch_instances"
        )
    rf = data.repetition_filter
    reader = BatchReader(
        shards,
        seed=data.seed,
        global_batch_instances=global_batch_instances,
        process_index=process_index,
        process_count=process_count,
        repetition_filter=(
            dict(min_period=rf.min_period, max_period=rf.max_period, max_count=rf.max_count) if rf.enabled else None
        ),
    )
    return Loader(reader, num_workers=data.num_workers, allow_fingerprint_change=data.allow_fingerprint_change)
