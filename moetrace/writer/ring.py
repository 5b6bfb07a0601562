"""The transport between the engine process and the writer process: a ring of int32 rows both map
(``SharedRows``: the engine side reserves and fills a step's rows, the writer process copies them out), and the
engine's record in shared memory (``EngineRecord``: steps submitted, why recording stopped)."""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from moetrace.trace.files import Assemblable, StepCapture

# The ring of rows shared with the writer process holds this many bytes of steps, and at least this many of the
# largest steps; a step that finds no room stops recording, said out loud.
RING_BYTES = 64 << 20
RING_LARGEST_STEPS = 4
SHARED_BYTES = 4096  # the engine's record (steps submitted, why recording stopped) in memory both processes map


class RingRows(NamedTuple):
    """Where one step's rows lie in a ``SharedRows`` ring: ``rows`` rows from row ``offset``; ``end`` is the ring's
    running count of reserved rows once they were reserved, which the writer process releases up to."""

    offset: int
    rows: int
    end: int


class SharedRows:
    """A ring of int32 rows [capacity, width] in memory that the engine process and the writer process both map
    (a memfd): the engine side reserves a step's rows (``reserve``, never blocking: None when the writer process
    has not yet released enough), has them written in place, and sends only where they lie; the writer process
    copies them out as the step's message arrives (``take``), which releases them. Steps are reserved and taken in
    order, so one running count of released rows, at the head of the memory, says what may be reused."""

    _RELEASED = struct.Struct("<Q")
    HEADER_BYTES = 64  # the released count, then the rows from a cache line of their own

    def __init__(self, fd: int, capacity: int, width: int) -> None:
        self.fd, self.capacity, self.width = fd, capacity, width
        self.memory = mmap.mmap(fd, self.nbytes(capacity, width))
        self.rows: npt.NDArray[np.int32] = np.frombuffer(
            self.memory, dtype=np.int32, count=capacity * width, offset=self.HEADER_BYTES).reshape(capacity, width)
        self._reserved = 0  # engine side: rows reserved so far, the rows skipped at each wrap included

    @classmethod
    def create(cls, capacity: int, width: int) -> SharedRows:
        fd = os.memfd_create("moetrace-rows")
        try:
            os.ftruncate(fd, cls.nbytes(capacity, width))
            return cls(fd, capacity, width)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def nbytes(cls, capacity: int, width: int) -> int:
        return cls.HEADER_BYTES + capacity * width * 4

    def reserve(self, count: int) -> RingRows | None:
        """``count`` consecutive rows for the next step (a step never wraps: the ring's tail is skipped instead), or
        None while the writer process has not released enough of them."""
        start = self._reserved
        if start % self.capacity + count > self.capacity:
            start += self.capacity - start % self.capacity
        end = start + count
        released = self._released()
        in_use_from = released if released < self._reserved else start  # nothing in use: the whole ring is free
        if end - in_use_from > self.capacity:
            return None
        self._reserved = end
        return RingRows(start % self.capacity, count, end)

    def in_use(self) -> int:
        """Engine side: rows reserved and not yet released by the writer process (skipped tails included)."""
        return self._reserved - self._released()

    def _released(self) -> int:
        released: int = self._RELEASED.unpack_from(self.memory)[0]
        return released

    def take(self, where: RingRows) -> npt.NDArray[np.int32]:
        """Writer process: a copy of one step's rows, which releases them (and every row reserved before them)."""
        rows = self.rows[where.offset : where.offset + where.rows].copy()
        self._RELEASED.pack_into(self.memory, 0, where.end)
        return rows

    def close(self) -> None:
        """Unmap and close; views still held elsewhere keep the memory mapped until they are gone."""
        del self.rows
        try:
            self.memory.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass
        os.close(self.fd)


class EngineRecord:
    """What the engine process leaves behind for the writer process, in memory both map: how many steps it
    submitted, and why recording stopped if it did. An engine killed with steps not yet sent, or after recording
    stopped, leaves that here, and the writer process says so in the manifest."""

    _STEPS = struct.Struct("<q")  # steps submitted, at the start
    _REASON = struct.Struct("<i")  # after it: bytes of the reason recording stopped (0: it did not); the text after
    _TEXT_AT = _STEPS.size + _REASON.size

    def __init__(self, memory: mmap.mmap) -> None:
        self.memory = memory

    def set_submitted(self, steps: int) -> None:
        self._STEPS.pack_into(self.memory, 0, steps)

    def set_failure(self, reason: str) -> None:
        text = reason.encode()[: SHARED_BYTES - self._TEXT_AT]
        self.memory[self._TEXT_AT : self._TEXT_AT + len(text)] = text
        self._REASON.pack_into(self.memory, self._STEPS.size, len(text))  # last: the text is whole once counted

    def read(self) -> tuple[int, str | None]:
        """Steps submitted, and why recording stopped (None: it did not)."""
        (steps,) = self._STEPS.unpack_from(self.memory)
        (length,) = self._REASON.unpack_from(self.memory, self._STEPS.size)
        reason = bytes(self.memory[self._TEXT_AT : self._TEXT_AT + length]).decode(errors="replace")
        return steps, reason if length else None


class Pending(Protocol):
    """A step whose device copies may still be in flight: the engine thread asks ``is_ready`` (never waits) and
    sends ``ready()`` once it is."""

    def is_ready(self) -> bool: ...

    def ready(self) -> StepCapture | Assemblable: ...


def ring_capacity(row_width: int, largest_step_rows: int) -> int:
    """Rows in the ring shared with the writer process: ``RING_BYTES`` of them, and room for ``RING_LARGEST_STEPS``
    of the largest steps."""
    return max(RING_BYTES // (4 * row_width), RING_LARGEST_STEPS * largest_step_rows, 1)
