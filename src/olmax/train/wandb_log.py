"""Weights & Biases logging (the `wandb` extra), set as OLMo-core's W&B callback is: project, entity, group, name,
tags and notes from the config's `wandb` section, the resolved config as the W&B run's config. W&B's own variables
choose the account and the server (WANDB_API_KEY, WANDB_BASE_URL, WANDB_MODE=offline). Process 0 logs.

W&B gets every metric of metrics.jsonl under its name (a vector as TensorBoard has it: `name/0`, `name/1`, ... and
a histogram), at its step and with its wall time, each step once, whatever stops the run:

- A step goes to W&B once a checkpoint at or after it is committed, and at the run's end. A restart redoes the
  steps after its checkpoint, and metrics.jsonl and TensorBoard drop the earlier values of those steps; a W&B run
  cannot drop a step (its rewind is a private preview), so it gets none a restart may redo. Until then the step
  is on the console, in TensorBoard and in metrics.jsonl (and on `olmax report RUN`'s page).
- Every attempt continues the W&B run whose id RUN/wandb.json keeps, and first sends the committed steps W&B does
  not have (an attempt killed before W&B wrote them down loses them: W&B writes its records every 15 s): those
  after the last step W&B's server has (`starting_step`, its resume), or offline, after the last step in the
  run's earlier offline records under RUN/wandb (`wandb sync` uploads them).

W&B failing in any way (not installed, no API key, a server that cannot be reached, a bad setting) never stops
training: one warning line, and W&B is left alone for the rest of the attempt.
"""

from __future__ import annotations

import json
import logging
import secrets
import struct
import sys
from pathlib import Path

import numpy as np

from olmax.config import RunConfig
from olmax.run_dir import RunDir, own_dir, replace_own

log = logging.getLogger(__name__)

BLOCK = 32768  # the records' file is a LevelDB log: 32 KiB blocks of chunks, after a 7-byte header
HEADER = b":W&B\xe1\xbe\x00"
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbLog:
    """The W&B run of one attempt: `add` each record metrics.jsonl keeps, `send(step)` once checkpoint `step` is
    committed, `close` at the end. Disabled (all but process 0, `wandb.enabled` false, or W&B failing) it does
    nothing."""

    def __init__(self, cfg: RunConfig, run_dir: Path, start: int, enabled: bool = True):
        self.run, self.pending = None, []
        if not (enabled and cfg.wandb.enabled):
            return
        try:
            self._start(cfg, RunDir(run_dir), start)
        except Exception as err:  # whatever W&B raises, training goes on
            self._off(err)

    def _start(self, cfg: RunConfig, run: RunDir, start: int) -> None:
        import wandb

        if run.wandb_record.exists():
            run_id = json.loads(run.wandb_record.read_text())["id"]
        else:
            run_id = secrets.token_hex(4)  # as W&B's own ids: 8 of [0-9a-z]
            replace_own(run.wandb_record, json.dumps({"id": run_id}) + "\n")
        own_dir(run.wandb_files)
        w = cfg.wandb
        # console="off": W&B leaves olmax's stdout and stderr alone (the host logs and the launcher read them).
        self.run = wandb.init(dir=str(run.location), id=run_id, resume="allow", project=w.project, entity=w.entity,
                              group=w.group, name=w.name or cfg.name, tags=w.tags or None, notes=w.notes,
                              config=cfg.model_dump(mode="json"),
                              settings=wandb.Settings(console="off", silent=True, login_timeout=10))
        first = 1 + last_offline_step(run.wandb_files, run_id) if self.run.offline else self.run.starting_step
        self.pending = [record for record in map(json.loads, run.metric_records()) if first <= record["step"] <= start]
        self.send(start)

    def add(self, record: dict) -> None:
        """A record of metrics.jsonl ({"step": N, "wall_time": T, metric: value, ...}), sent by `send`."""
        if self.run is not None:
            self.pending.append(record)

    def send(self, committed: int) -> None:
        """Log the records of the steps up to `committed` (the newest committed checkpoint's)."""
        if self.run is None or not self.pending or self.pending[0]["step"] > committed:
            return
        import wandb

        try:
            while self.pending and self.pending[0]["step"] <= committed:
                record = self.pending.pop(0)
                values = {"_timestamp": record["wall_time"]} if "wall_time" in record else {}
                for name, value in record.items():
                    if isinstance(value, list):  # as the event files have a vector: a histogram, a scalar an index
                        values[name] = wandb.Histogram(np_histogram=np.histogram(np.asarray(value, np.float64), 30))
                        values |= {f"{name}/{i}": v for i, v in enumerate(value)}
                    elif name not in ("step", "wall_time"):
                        values[name] = value
                self.run.log(values, step=record["step"])
        except Exception as err:
            self._off(err)

    def close(self, committed: int, failed: bool) -> None:
        """Send what `committed` allows and end the attempt's W&B run (W&B writes, or uploads, what it holds)."""
        self.send(committed)
        if self.run is not None:
            try:
                self.run.finish(exit_code=1 if failed else 0)
            except Exception as err:
                self._off(err)
            self.run = None

    def _off(self, err: Exception) -> None:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        line = (f"olmax: W&B logging is off for this attempt ({type(err).__name__}{': ' + reason if reason else ''}); "
                "the metrics still go to TensorBoard and metrics.jsonl")
        log.warning(line)
        print(line, file=sys.stderr, flush=True)
        self.run, self.pending = None, []


def last_offline_step(directory: Path, run_id: str) -> int:
    """The last step of W&B run `run_id` in the offline records under `directory` (0: none): what `wandb sync`
    would upload of it. A record torn by a kill ends its file."""
    steps = [0]
    for path in sorted(Path(directory).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        steps += [record.history.step.num for record in records(path.read_bytes())
                  if record.WhichOneof("record_type") == "history"]
    return max(steps)


def records(data: bytes):
    """The records of a W&B transaction log (a `.wandb` file): W&B's header, then LevelDB's log format (blocks of
    32 KiB; each chunk a 4-byte checksum, a 2-byte length and its kind: a whole record, or its first, middle or
    last part), each record one of W&B's `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    if not data.startswith(HEADER):
        return
    offset, parts = len(HEADER), b""
    while offset + 7 <= len(data):
        if BLOCK - offset % BLOCK < 7:  # a block's tail too short for a chunk is padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        chunk = data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind not in (FULL, FIRST, MIDDLE, LAST) or len(chunk) < length:
            return  # zeros where the writer stopped, or a chunk cut short
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            try:
                yield wandb_internal_pb2.Record.FromString(parts)
            except Exception:  # a record cut short by the kill
                return
