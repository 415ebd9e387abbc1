"""A byte semaphore: what keeps the memory of a save or a restore bounded whatever its size."""

from __future__ import annotations

import threading


class ByteBudget:
    """``take(n)`` blocks while more than ``cap`` bytes are in flight (one oversize item may pass alone, so an
    item larger than the cap never blocks forever); ``give(n)`` returns them."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self._lock = threading.Lock()
        self.cond = threading.Condition(self._lock)

    def take(self, n: int) -> None:
        # Room is tested under the bare lock first (a C call, where the condition's is Python's): a save of
        # 10,000 small files takes 10,000 times, nearly always with room.
        with self._lock:
            if self.used == 0 or self.used + n <= self.cap:
                self.used += n
                return
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.cap)
            self.used += n

    def give(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()
