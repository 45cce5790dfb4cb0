"""What tuning measures a graph on: input sets from QNN input lists, as the backend receives them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from quiver.errors import QuiverError, TuningError
from quiver.runtime.context import Context
from quiver.tuning.profiler import FeedSet


@dataclass(frozen=True)
class Workload:
    graph: str
    feed_sets: tuple[FeedSet, ...]


def workload_of(context: Context, graph: str, feeds: Sequence[Mapping[str, object]]) -> Workload:
    """Feeds (as for `Graph.execute`) turned into what the backend gets: checked, with the bound tensors."""
    handle = context.graph(graph)
    if not feeds:
        raise TuningError(f"graph {graph!r}: tuning needs at least one input set")
    return Workload(graph, tuple(FeedSet(*handle.backend_feeds(f)) for f in feeds))


def workloads_from_input_lists(
    context: Context,
    lists: Sequence[tuple[str | None, Path]],
    graphs: Sequence[str] = (),
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> list[Workload]:
    """One workload per graph: `lists` are (graph or None, input list); a list without a graph serves every
    graph in `graphs` (default: all) whose inputs it names, and must serve at least one."""
    from quiver.runtime.netrun import parse_input_list

    wanted = list(graphs) or context.graph_names
    unknown = sorted(set(wanted) - set(context.graph_names))
    if unknown:
        raise TuningError(f"no graph {unknown[0]!r} in this context; its graphs are {context.graph_names}")
    found: dict[str, Workload] = {}
    for graph, path in lists:
        targets = [graph] if graph is not None else wanted
        if graph is not None and graph not in context.graph_names:
            raise TuningError(f"--input-list names graph {graph!r}; the context's graphs are {context.graph_names}")
        served, errors = [], []
        for name in targets:
            handle = context.graph(name)
            try:
                names = {i.name for i in handle.inputs}
                feeds = parse_input_list(path, handle, {k: v for k, v in (shapes or {}).items() if k in names})
                found[name] = workload_of(context, name, feeds)
                served.append(name)
            except QuiverError as exc:  # names, shapes or types that are not this graph's
                errors.append(f"{name}: {exc}")
        if not served:
            raise TuningError(f"input list {path} fits no graph to tune ({'; '.join(errors)})")
    if not found:
        raise TuningError("tuning needs inputs: give --input-list")
    return [found[name] for name in context.graph_names if name in found]
