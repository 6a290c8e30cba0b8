"""The compiling step's report names each compiled graph with its forward and backward compile time."""

import torch

from flashdraft.train import compile_report


def _square_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x @ w).relu() ** 2).sum()


def test_a_compiled_forward_and_its_backward_are_one_graph_with_both_times():
    before = compile_report.now()
    torch._dynamo.reset()
    compiled = torch.compile(_square_sum, backend="inductor")
    w = torch.randn(16, 16, requires_grad=True)
    # a cache hit (an earlier run's) would load the backward without compiling it
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled(torch.randn(8, 16), w).backward()

    graphs = compile_report.graphs_compiled_since(before)
    assert [g.name for g in graphs] == ["_square_sum"]
    (graph,) = graphs
    assert graph.forward_s > 0 and graph.backward_s > 0
    # the stages nest: dynamo's tracing holds AOT autograd, which holds inductor
    stages = graph.phases
    for side in ("forward", "backward"):
        assert stages[f"{side}.inductor_cumulative_compile_time"] > 0
    assert (
        stages["forward.dynamo_cumulative_compile_time"]
        >= stages["forward.aot_autograd_cumulative_compile_time"]
        >= stages["forward.inductor_cumulative_compile_time"]
    )
    line = compile_report.describe(graphs, step_seconds=graph.forward_s + graph.backward_s + 1.0)
    assert line.startswith("1 graph(s) compiled in ")
    assert "_square_sum " in line and " s backward" in line

    # a later window sees nothing of it
    assert compile_report.graphs_compiled_since(compile_report.now()) == []


def test_graphs_are_listed_largest_first():
    graphs = [
        compile_report.CompiledGraph("small", "0/0", 1.0, 0.0, 0.5),
        compile_report.CompiledGraph("large", "1/0", 2.0, 3.0, 1.0),
    ]
    line = compile_report.describe(graphs, step_seconds=10.0)
    assert line == (
        "2 graph(s) compiled in 6.0 s of the step's 10.0 s (Triton kernel builds 1.5 s of it): "
        "large 2.0 s + 3.0 s backward, small 1.0 s"
    )


def test_the_compile_record_goes_to_metrics_jsonl_and_not_to_the_console(tmp_path, capsys):
    """The trainer writes each compiling step's graphs, with their stages, as a `compile` record beside the
    training rows; the console keeps its one-line summary."""
    from dataclasses import asdict

    from flashdraft.run_protocol import read_metrics
    from flashdraft.train.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False)
    graph = compile_report.CompiledGraph("forward", "0/0", 2.0, 3.0, 1.0, {"forward.gc_time": 0.1})
    logger.log(1, {"graphs": [asdict(graph)]}, kind="compile", console=False)
    logger.log(1, {"loss": 2.5})
    logger.close()
    (record,) = read_metrics(tmp_path / "metrics.jsonl", "compile")
    assert record["step"] == 1 and record["graphs"][0]["phases"] == {"forward.gc_time": 0.1}
    assert [r["kind"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["compile", "train"]
    assert "compile" not in capsys.readouterr().out


def test_a_graph_with_dynamic_sizes_compiles_its_backward_with_its_forward():
    """What the report shows for the drafter's layers (their context length is dynamic): no backward record;
    the backward was compiled with the forward, before it ran, and the frame's seconds hold both."""
    before = compile_report.now()
    torch._dynamo.reset()
    compiled = torch.compile(_square_sum, backend="inductor", dynamic=True)
    w = torch.randn(16, 16, requires_grad=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        out = compiled(torch.randn(8, 16), w)
        (graph,) = compile_report.graphs_compiled_since(before)
        assert graph.forward_s > 0 and graph.backward_s == 0
        out.backward()  # compiles nothing more
    (after,) = compile_report.graphs_compiled_since(before)
    assert after.backward_s == 0 and after.forward_s == graph.forward_s
    assert w.grad is not None
