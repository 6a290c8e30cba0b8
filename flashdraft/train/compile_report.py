"""Where a compiling step's time went: the graphs torch.compile built during it, each with its forward
and its backward compile seconds (docs/shards.md, "The first step").

A user whose first step takes 40 s sees which code paid for it (the drafter layer, the loss) instead of
one number. The records are dynamo's own
(`torch._dynamo.utils.get_compilation_metrics`): one per compiled frame, and one per lazily compiled
backward, which carries its forward's compile id but no name. A graph with dynamic sizes (the drafter's
layers, their context length dynamic) has no backward record: AOT autograd compiles its backward with
its forward, inside the frame's record, so its `forward_s` holds both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# The stages of one compile as dynamo times them, outermost first; each includes the ones after it
# (dynamo's tracing includes AOT autograd, which includes inductor, which includes its code generation,
# which waits for Triton's kernel builds). Written to metrics.jsonl per graph: where a slow compile went.
PHASES = (
    "dynamo_cumulative_compile_time",
    "aot_autograd_cumulative_compile_time",
    "inductor_cumulative_compile_time",
    "inductor_code_gen_cumulative_compile_time",
    "triton_compile_time",
    "joint_graph_pass_time",
    "pre_grad_pass_time",
    "post_grad_pass_time",
    "gc_time",
)


@dataclass
class CompiledGraph:
    name: str  # the compiled function's code name
    compile_id: str  # dynamo's "frame/recompile" id
    forward_s: float  # the frame's whole compile: tracing, AOT autograd, inductor's forward
    backward_s: float  # inductor's compile of the backward, at the first backward (0: with the forward)
    kernels_s: float  # of both: Triton's kernel builds
    phases: dict[str, float] = field(default_factory=dict)  # "forward.<PHASES entry>" and "backward.…", s
    code: str = ""  # the compiled function's "file:first line" (`code_of`): two functions of one name apart


def _records() -> list:
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # a torch without dynamo compiles nothing
        return []
    return list(get_compilation_metrics())


def _seconds(record, name: str) -> float | None:
    """A record field in seconds: `<name>_s`, or `<name>_us` in microseconds; None where torch has neither."""
    value = getattr(record, f"{name}_s", None)
    if value is None:
        micros = getattr(record, f"{name}_us", None)
        value = micros / 1e6 if micros is not None else None
    return None if value is None else float(value)


def graphs_compiled_since(since: float) -> list[CompiledGraph]:
    """The graphs whose compile began at or after `since` (a `time.time()`), in compile order."""
    graphs: dict[str, CompiledGraph] = {}
    for record in _records():
        if (getattr(record, "start_time", None) or 0.0) < since:
            continue
        key = str(record.compile_id)
        graph = graphs.setdefault(key, CompiledGraph("?", key, 0.0, 0.0, 0.0))
        forward = getattr(record, "is_forward", True)
        if forward:
            graph.name = record.co_name or graph.name
            filename, line = getattr(record, "co_filename", None), getattr(record, "co_firstlineno", None)
            graph.code = f"{filename}:{line}" if filename else graph.code
            graph.forward_s += _seconds(record, "entire_frame_compile_time") or 0.0
        else:
            graph.backward_s += _seconds(record, "inductor_compile_time") or 0.0
        graph.kernels_s += _seconds(record, "triton_compile_time") or 0.0
        for phase in PHASES:
            seconds = _seconds(record, phase)
            if seconds:
                stage = f"{'forward' if forward else 'backward'}.{phase}"
                graph.phases[stage] = round(graph.phases.get(stage, 0.0) + seconds, 3)
    return list(graphs.values())


def describe(graphs: list[CompiledGraph], step_seconds: float) -> str:
    """One line: the compile seconds in all, then per graph, largest first."""
    total = sum(g.forward_s + g.backward_s for g in graphs)
    parts = []
    for g in sorted(graphs, key=lambda g: -(g.forward_s + g.backward_s)):
        backward = f" + {g.backward_s:.1f} s backward" if g.backward_s else ""
        parts.append(f"{g.name} {g.forward_s:.1f} s{backward}")
    kernels = sum(g.kernels_s for g in graphs)
    return (
        f"{len(graphs)} graph(s) compiled in {total:.1f} s of the step's {step_seconds:.1f} s "
        f"(Triton kernel builds {kernels:.1f} s of it): " + ", ".join(parts)
    )


def code_of(function: Callable) -> str:
    """A function's "file:first line", as `CompiledGraph.code` names the function a graph compiled."""
    code = function.__code__
    return f"{code.co_filename}:{code.co_firstlineno}"


def repeated_layer_graphs(
    graphs: list[CompiledGraph], layer_forward: Callable, layers: int, kinds: int
) -> str | None:
    """A warning, or None: layers of one class, which share `layer_forward`'s compiled graphs, compiled more
    of them in one step than they have kinds. A step compiles each kind once at most (training, an
    evaluation, a new batch shape come in different steps), so more means a guard particular to each layer
    instance (a function or a value stored on it) and one compile per layer: stop 63's FP8 drafter compiled
    its layer five times in the first step, silently, until the warm-up was timed (docs/fp8.md)."""
    count = sum(1 for g in graphs if g.code == code_of(layer_forward))
    if count <= kinds:
        return None
    return (
        f"the drafter's {layers} layers compiled {count} graphs of {layer_forward.__qualname__} in this step "
        f"where their {kinds} layer kind(s) share one graph each: something stored on each layer instance "
        "makes torch.compile guard on it, and every extra graph adds its compile time to the warm-up"
    )


def now() -> float:
    """The clock `graphs_compiled_since` compares with (dynamo stamps its records with wall time)."""
    return time.time()
