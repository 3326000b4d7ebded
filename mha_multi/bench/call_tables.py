"""The tables of what a call costs around its kernels: Llama-shaped decoding, host time, calls.

Each takes the measurements of one or several backends and gives a
:class:`~mha_multi.bench.cells.Table` across them, which the report
(:mod:`mha_multi.bench.tables`) and the results page
(:mod:`mha_multi.bench.page`) show.
"""

from __future__ import annotations

from collections.abc import Sequence

from mha_multi.bench.cells import Table, ratio, table

__all__ = ["calls_table", "host_table", "llama_table"]

#: What a generation row's note says before its difference from ours.
_DIFFERENCE = "max |this - cached| "


def _shape(m: dict) -> dict:
    return m.get("shape") or {}


def _heads(m: dict) -> str:
    heads = _shape(m).get("num_heads", 0)
    return f"{heads}/{_shape(m).get('num_kv_heads') or heads}"


def llama_table(measurements: Sequence[dict]) -> Table:
    """Generation by a layer with rotary positions (a Llama-shaped layer) against the
    hand-written rotary loop, per backend (and execution mode) and dtype.

    The ratio is ours / hand-written in tokens per second: above 1 when ours
    is faster; the last column is how far the hand-written loop's outputs
    are from ours.
    """
    generated = [
        m
        for m in measurements
        if m["mode"] == "generate"
        and m["implementation"] in ("cached", "hand-written")
        and _shape(m).get("rotary")
    ]
    rows, shown = [], []
    for group in sorted({(m["backend"], m["dtype"], _heads(m)) for m in generated}):
        ways = {
            m["implementation"]: m
            for m in generated
            if (m["backend"], m["dtype"], _heads(m)) == group
        }
        shown += ways.values()
        ours, hand = ways.get("cached", {}), ways.get("hand-written", {})
        rates = [
            "-" if m.get("tokens_per_s") is None else f"{m['tokens_per_s']:.0f}"
            for m in (ours, hand)
        ]
        note = hand.get("note", "")
        difference = note.split(_DIFFERENCE)[-1] if _DIFFERENCE in note else "-"
        speed = ratio(ours.get("tokens_per_s"), hand.get("tokens_per_s"))
        rows.append((*group, *rates, speed, difference))
    ways = ("ours (tokens/s)", "hand-written (tokens/s)", "ours / hand-written")
    return table(("backend", "dtype", "heads (q/kv)", *ways, "max difference"), rows, shown)


#: A host row's route as the tables name it.
ROUTES = {"cpu": "CPU's", "gpu": "a GPU's, on the CPU"}


def host_table(measurements: Sequence[dict]) -> Table:
    """The tiny layers' host time per call, ours against the hand-written call and
    step, per backend, layer, route and call (:func:`~mha_multi.bench.host.time_host`):
    the rotary layer's rows first, then the plain layer's.

    The ratio is ours / hand-written in time: below 1 when ours is faster.
    """
    timed = [m for m in measurements if m["mode"].startswith("host: ")]

    def key(m: dict) -> tuple[str, str, str, str]:
        layer = f"{'rotary' if _shape(m).get('rotary') else 'plain'}, {_heads(m)} heads"
        route = _shape(m).get("route", "cpu")
        return m["backend"], layer, route, m["mode"].removeprefix("host: ")

    def order(group: tuple[str, str, str, str]) -> tuple:
        backend, layer, route, what = group
        return backend, not layer.startswith("rotary"), route, what != "one token"

    rows, shown = [], []
    for group in sorted({key(m) for m in timed}, key=order):
        ways = {m["implementation"]: m for m in timed if key(m) == group}
        shown += ways.values()
        ours, hand = ways.get("ours", {}), ways.get("hand-written", {})
        micros = [
            "-" if m.get("seconds") is None else f"{m['seconds'] * 1e6:.0f}" for m in (ours, hand)
        ]
        speed = ratio(ours.get("seconds"), hand.get("seconds"))
        backend, layer, route, what = group
        rows.append((backend, layer, ROUTES.get(route, route), what, *micros, speed))
    ways = ("ours (us)", "hand-written (us)", "ours / hand-written")
    return table(("backend", "layer", "route", "call", *ways), rows, shown)


def calls_table(measurements: Sequence[dict]) -> Table:
    """Python function calls per call (cProfile), per backend and call: ours and the
    hand-written anchor, plain and with rotary positions
    (:func:`~mha_multi.bench.host.count_calls`)."""
    counted = [m for m in measurements if m["mode"].startswith("python calls: ")]

    def key(m: dict) -> tuple[str, str]:
        return m["backend"], m["mode"].removeprefix("python calls: ")

    order = {"one token": 0, "decoding step": 1}
    rows, shown = [], []
    for group in sorted({key(m) for m in counted}, key=lambda g: (g[0], order.get(g[1], 2), g[1])):
        cells = []
        for rotary in (False, True):
            for implementation in ("ours", "hand-written"):
                m = next(
                    (
                        m
                        for m in counted
                        if key(m) == group
                        and m["implementation"] == implementation
                        and bool(_shape(m).get("rotary")) == rotary
                    ),
                    None,
                )
                shown += [m] if m else []
                cells.append("-" if m is None or m.get("calls") is None else f"{m['calls']:.0f}")
        rows.append((*group, *cells))
    ways = [f"{kind}: {way}" for kind in ("plain", "rotary") for way in ("ours", "hand-written")]
    return table(("backend", "call", *ways), rows, shown)
