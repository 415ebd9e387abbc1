"""The progress chart of the Checkpoints tab: an inline SVG drawn on the server, one series per try.

No JavaScript and no foreign resource (the view's Content-Security-Policy allows neither): this module turns the
kept checkpoints of one identity into numbers and short labels, and ``templates/_chart.html`` writes them as SVG
elements (autoescaped; colours come from classes in the view's one stylesheet, so the chart follows the light
and dark schemes of the page).

What is drawn, from the head record and the manifests of its kept checkpoints only:

* x: when each checkpoint was committed (UTC); y: the items done, the sum of its ``resume()`` cursors'
  positions (``extra["cursors"]``, :mod:`airflow_stateful.core.records.cursors`), or the checkpoint's number when no kept checkpoint has cursors;
* one series (colour and marker shape) per try (``writer.try_number``; per epoch for writers outside Airflow);
* a dashed vertical line where a new lease (a retry, or a rescheduled try) committed its first kept checkpoint,
  having resumed from the checkpoint before it;
* a cross on the last kept checkpoint of each lease that another one superseded: from there a write by that
  writer is fenced (refused by the epoch check). Whether it was still alive the head cannot tell;
* a dotted vertical line where the current lease holder took the lease, when it has no checkpoint yet, and one
  where that lease expired, when it did;
* notes on epochs that held the lease but left no kept checkpoint (epoch numbers that jump).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

WIDTH, HEIGHT = 760, 280
LEFT, RIGHT, TOP, BOTTOM = 64, 20, 28, 40
SERIES_CLASSES = 6
"""Series colours (``.s0`` ... ``.s5`` in stateful.css); a seventh try reuses the first colour with another shape."""
SHAPES = ("circle", "square", "triangle", "diamond")
_TIME_STEPS = (
    *(1, 2, 5, 10, 15, 30),
    *(60, 120, 300, 600, 900, 1800),
    *(3600, 7200, 10800, 21600, 43200),
    *(86400, 2 * 86400, 7 * 86400, 14 * 86400, 30 * 86400, 91 * 86400, 365 * 86400),
)


@dataclass(frozen=True)
class Point:
    """One kept checkpoint whose manifest was read."""

    seq: int
    at: float
    epoch: int
    try_number: int | None
    #: the sum of its resume() cursors' positions; None when it has none
    items: int | None


@dataclass(frozen=True)
class LeaseMarks:
    """The current lease: marked where it was taken when its holder has no kept checkpoint yet, and where it
    expired when it did."""

    holder: str
    epoch: int
    acquired_at: float
    #: set when the lease expired (the holder is gone)
    expired_at: float | None = None


@dataclass(frozen=True)
class Marker:
    shape: str
    x: str
    y: str
    #: for polygons: the corner points; for squares: the top left corner "x,y"
    points: str
    title: str

    @property
    def corner(self) -> list[str]:
        return self.points.split(",")


@dataclass(frozen=True)
class Series:
    css: str
    label: str
    line: str
    markers: list[Marker]


@dataclass
class VLine:
    kind: str  # "resume", "lease" or "expired"
    at: float
    label: str
    title: str
    x: str = ""
    label_x: str = ""
    label_y: str = ""
    anchor: str = "start"


@dataclass(frozen=True)
class Cross:
    path: str
    title: str


@dataclass(frozen=True)
class Tick:
    pos: str
    label: str
    #: where the label's baseline goes (a y tick's label is centred on its line)
    label_pos: str = ""


@dataclass
class Chart:
    y_caption: str
    series: list[Series] = field(default_factory=list)
    lines: list[VLine] = field(default_factory=list)
    crosses: list[Cross] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right: int = WIDTH - RIGHT
    top: int = TOP
    bottom: int = HEIGHT - BOTTOM
    #: which of the marks below the legend explains (only those that occur)
    has_resume: bool = False
    has_cross: bool = False
    has_lease: bool = False


def _num(v: float) -> str:
    return f"{v:.1f}"


def compact(n: float) -> str:
    """``950``, ``12k``, ``1.5M``: tick labels that fit."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) or abs(value) >= 10 else f"{value:.1f}{unit}"
    return f"{n:.0f}" if n == int(n) else f"{n:.1f}"


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is at least ``raw`` (and at least 1: y values are counts)."""
    if raw <= 1:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * magnitude >= raw:
            return float(m * magnitude)
    return float(10 * magnitude)  # pragma: no cover - the loop always returns


def _when(ts: float, fmt: str) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime(fmt)


def _time_ticks(t0: float, t1: float) -> list[tuple[float, str]]:
    """Ticks on whole steps of UTC time (a 6th of the span at most), labelled as precisely as the step needs."""
    span = max(t1 - t0, 1.0)
    step = next((s for s in _TIME_STEPS if span / s <= 6), _TIME_STEPS[-1])
    if step < 60:
        fmt = "%H:%M:%S"
    elif step < 86400:
        same_day = _when(t0, "%Y-%m-%d") == _when(t1, "%Y-%m-%d")
        fmt = "%H:%M" if same_day else "%m-%d %H:%M"
    else:
        fmt = "%Y-%m-%d"
    ticks: list[tuple[float, str]] = []
    t = float(math.ceil(t0 / step) * step)
    while t <= t1 and len(ticks) < 12:
        ticks.append((t, _when(t, fmt)))
        t += step
    return ticks


def _series_key(point: Point) -> tuple[str, int]:
    return ("try", point.try_number) if point.try_number is not None else ("epoch", point.epoch)


def _marker(shape: str, x: float, y: float, title: str) -> Marker:
    r = 4.5
    if shape == "triangle":
        pts = f"{_num(x)},{_num(y - r)} {_num(x + r)},{_num(y + r * 0.8)} {_num(x - r)},{_num(y + r * 0.8)}"
    elif shape == "diamond":
        pts = (
            f"{_num(x)},{_num(y - r)} {_num(x + r)},{_num(y)} {_num(x)},{_num(y + r)} {_num(x - r)},{_num(y)}"
        )
    elif shape == "square":
        pts = f"{_num(x - 4)},{_num(y - 4)}"
    else:
        pts = ""
    return Marker(shape=shape, x=_num(x), y=_num(y), points=pts, title=title)


def _epochs_between(low: int, high: int) -> str:
    return f"epoch {low}" if low == high else f"epochs {low}-{high}"


def _cross(point: Point, x_of: Callable[[float], float], y: float) -> Cross:
    """The mark on the last kept checkpoint of a lease that a newer one superseded (epochs rise by one per lease
    taken, so the next holder had ``epoch + 1``)."""
    x, d = x_of(point.at), 5.0
    return Cross(
        path=f"M{_num(x - d)},{_num(y - d)}L{_num(x + d)},{_num(y + d)}"
        f"M{_num(x - d)},{_num(y + d)}L{_num(x + d)},{_num(y - d)}",
        title=f"the last kept checkpoint of epoch {point.epoch} (#{point.seq}); its lease passed to epoch "
        f"{point.epoch + 1}, so from here any write by that writer is fenced",
    )


def _lease_lines(lease: LeaseMarks, *, taken: bool) -> list[VLine]:
    """The current lease's lines: where it was taken when ``taken`` (its holder has no kept checkpoint yet), and
    where it expired when it did."""
    lines = []
    if taken:
        title = f"{lease.holder} took the lease here (epoch {lease.epoch}) and has no kept checkpoint yet"
        lines.append(VLine(kind="lease", at=lease.acquired_at, label="lease taken", title=title))
    if lease.expired_at is not None:
        title = f"the lease of {lease.holder} expired here (not renewed: the writer is gone)"
        lines.append(VLine(kind="expired", at=lease.expired_at, label="lease expired", title=title))
    return lines


def build_chart(points: Sequence[Point], *, lease: LeaseMarks | None = None) -> Chart | None:
    """The chart of ``points`` (kept checkpoints, any order); ``None`` when there is nothing to draw."""
    if not points and lease is None:
        return None
    ordered = sorted(points, key=lambda p: p.seq)
    by_items = any(p.items is not None for p in ordered)
    chart = Chart(
        y_caption="items done (sum of the resume() cursors)"
        if by_items
        else "checkpoint number (no resume() cursors recorded)"
    )

    def value(p: Point) -> float:
        return float((p.items or 0) if by_items else p.seq)

    taken = lease is not None and not any(p.epoch == lease.epoch for p in ordered)
    lease_lines = [] if lease is None else _lease_lines(lease, taken=taken)
    times = [p.at for p in ordered] + [line.at for line in lease_lines]
    if not times:
        return None
    t0, t1 = min(times), max(times)
    if t1 - t0 < 60:  # one point, or a burst: give it a minute of room
        t0, t1 = t0 - 30, t1 + 30
    pad = (t1 - t0) * 0.04
    t0, t1 = t0 - pad, t1 + pad
    top_value = max((value(p) for p in ordered), default=0.0)
    y_step = _nice_step(max(top_value, 1.0) / 4)
    y_max = y_step * max(math.ceil(top_value / y_step), 1)
    if top_value >= y_max:  # keep the highest point off the frame
        y_max += y_step

    def x_of(t: float) -> float:
        return chart.left + (t - t0) / (t1 - t0) * (chart.right - chart.left)

    def y_of(v: float) -> float:
        return chart.bottom - v / y_max * (chart.bottom - chart.top)

    chart.x_ticks = [Tick(pos=_num(x_of(t)), label=label) for t, label in _time_ticks(t0, t1)]
    n = 0
    while n * y_step <= y_max + 1e-9 and n <= 10:
        y = y_of(n * y_step)
        chart.y_ticks.append(Tick(pos=_num(y), label=compact(n * y_step), label_pos=_num(y + 4)))
        n += 1

    keys: list[tuple[str, int]] = []
    for p in ordered:
        if _series_key(p) not in keys:
            keys.append(_series_key(p))
    for index, key in enumerate(keys):
        shape = SHAPES[index % len(SHAPES)]
        mine = [p for p in ordered if _series_key(p) == key]
        label = f"try {key[1]}" if key[0] == "try" else f"epoch {key[1]} (no try number)"
        markers = [
            _marker(
                shape,
                x_of(p.at),
                y_of(value(p)),
                f"#{p.seq}, {label}, epoch {p.epoch}, {_when(p.at, '%Y-%m-%d %H:%M:%S')} UTC"
                + (f", {p.items:,} items done" if p.items is not None else ""),
            )
            for p in mine
        ]
        polyline = " ".join(f"{_num(x_of(p.at))},{_num(y_of(value(p)))}" for p in mine)
        chart.series.append(
            Series(css=f"s{index % SERIES_CLASSES}", label=label, line=polyline, markers=markers)
        )

    skipped: list[str] = []
    for before, after in itertools.pairwise(ordered):
        if after.epoch == before.epoch:
            continue
        who = f"try {after.try_number}" if after.try_number is not None else f"epoch {after.epoch}"
        resumed_from = (
            f"{before.items:,} items" if by_items and before.items is not None else f"#{before.seq}"
        )
        chart.lines.append(
            VLine(
                kind="resume",
                at=after.at,
                label=f"{who} resumed",
                title=f"{who} (epoch {after.epoch}) resumed from checkpoint #{before.seq} ({resumed_from}); "
                f"its first kept checkpoint is #{after.seq}",
            )
        )
        chart.crosses.append(_cross(before, x_of, y_of(value(before))))
        if after.epoch > before.epoch + 1:
            skipped.append(_epochs_between(before.epoch + 1, after.epoch - 1))
    chart.lines += lease_lines
    if lease is not None and taken and ordered and lease.epoch > ordered[-1].epoch + 1:
        skipped.append(_epochs_between(ordered[-1].epoch + 1, lease.epoch - 1))
    if lease is not None and ordered and lease.epoch != ordered[-1].epoch:
        chart.crosses.append(_cross(ordered[-1], x_of, y_of(value(ordered[-1]))))
    for k, vline in enumerate(sorted(chart.lines, key=lambda v: v.at)):
        x = x_of(vline.at)
        vline.x = _num(x)
        vline.anchor = "end" if x > chart.right - 140 else "start"
        vline.label_x = _num(x - 3 if vline.anchor == "end" else x + 3)
        vline.label_y = _num(chart.top - 16 + 12 * (k % 2))
    if skipped:
        chart.notes.append(
            f"{', '.join(skipped)} took the lease but left no kept checkpoint (killed or fenced before their "
            "first commit, or their checkpoints were rolled back)"
        )
    chart.has_resume = any(line.kind == "resume" for line in chart.lines)
    chart.has_cross = bool(chart.crosses)
    chart.has_lease = any(line.kind in ("lease", "expired") for line in chart.lines)
    return chart
