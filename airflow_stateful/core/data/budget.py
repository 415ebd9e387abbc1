"""A byte semaphore: what keeps the memory of a save or a restore bounded whatever its size."""

from __future__ import annotations

import threading


class ByteBudget:
    """``take(n)`` blocks while more than ``cap`` bytes are in flight (one oversize item may pass alone, so an
    item larger than the cap never blocks forever); ``give(n)`` returns them."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self.cond = threading.Condition()

    def take(self, n: int) -> None:
        with self.cond:
            # Tested before waiting: a save of 10,000 small files takes 10,000 times, nearly always with room.
            if not (self.used == 0 or self.used + n <= self.cap):
                self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.cap)
            self.used += n

    def give(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()
