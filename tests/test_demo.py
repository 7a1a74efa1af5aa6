"""The demo end to end (3 steps of a small configuration into a temporary folder), its
report.json schema, its settings, the CLI entry points, and the graphed-step logic on CPU
(which steps are eager, the static input buffers) with a stand-in for the CUDA graphs."""
import copy
import dataclasses
import json
import runpy
import sys

import pytest
import torch

from fp8train import DelayedScaling, Format, cli, demo
from fp8train.data import ByteCorpus
from fp8train.demo.config import PRESETS, DemoConfig, from_args, parser
from fp8train.demo.report import print_table
from fp8train.demo.step import StepPlan, TrainStep, fp8_region
from fp8train.demo.train import RunResult, train_model
from fp8train.inspect import load
from fp8train.models import GPT


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_out")
    assert cli.main(["demo", "--device", "cpu", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                     "--eval-every", "2", "--inspect-every", "2", "--fp8-format", "e4m3", "--out", str(out)]) == 0
    return out


def test_demo_writes_the_three_files(demo_out, capsys):
    for name in ("loss.png", "scaling.png", "report.json"):
        assert (demo_out / name).read_bytes()[:4 if name.endswith("png") else 1] in (b"\x89PNG", b"{"), name
    assert (demo_out / "numerics_fp8_delayed.jsonl").exists() and (demo_out / "numerics_fp8_current.jsonl").exists()


def test_report_schema(demo_out):
    report = json.loads((demo_out / "report.json").read_text())
    demo.check_report(report)
    assert [r["name"] for r in report["runs"]] == ["bf16", "fp8 delayed", "fp8 current"]
    assert report["runs"][0]["recipe"] is None and "DelayedScaling" in report["runs"][1]["recipe"]
    assert all("Format.E4M3" in r["recipe"] for r in report["runs"][1:])
    assert report["config"]["fp8_format"] == "e4m3" and report["config"]["graphed"] is False
    assert set(report["gaps"]) == {"fp8 delayed", "fp8 current"}
    assert report["config"]["steps"] == 3 and report["model"]["seq_len"] == 32
    assert report["device"]["type"] == "cpu" and report["versions"]["torch"]
    for run in report["runs"]:
        assert [s for s, _ in run["train_loss"]] == [1, 2, 3]
        assert [s for s, _ in run["val_loss"]] == [2, 3]  # every 2 steps and the last
        assert run["final_val_loss"] == run["val_loss"][-1][1] > 0
    bad = dict(report, runs=[{k: v for k, v in report["runs"][0].items() if k != "tokens_per_s"}])
    with pytest.raises(ValueError, match="tokens_per_s"):
        demo.check_report(bad)


def test_numerics_log_covers_the_fp8_runs(demo_out):
    from fp8train.inspect import load
    records = load(demo_out / "numerics_fp8_delayed.jsonl")
    assert {r["step"] for r in records} == {0, 2}
    assert {r["role"] for r in records} == {"input", "weight", "grad_output"}
    assert {r["dtype"] for r in records} == {"float8_e4m3fn"}  # --fp8-format e4m3: gradients too


def test_same_start_same_batches(demo_out):
    # The three runs start from the same weights and see the same first batch, so their
    # first losses agree to within the precision of the forward (bf16 vs FP8).
    report = json.loads((demo_out / "report.json").read_text())
    first = [r["train_loss"][0][1] for r in report["runs"]]
    assert max(first) - min(first) < 0.05 * first[0]


def test_config_checks_and_schedule():
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)
    with pytest.raises(ValueError, match="unknown GPT config"):
        DemoConfig(model="huge")
    cfg = DemoConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == 0.1 and cfg.lr_at(9) == 1.0 and cfg.lr_at(10) == 1.0
    assert cfg.lr_at(99) == pytest.approx(0.1, abs=1e-3)
    assert PRESETS["cuda"].model == "gpt125m" and PRESETS["cpu"].model == "tiny"
    with pytest.raises(SystemExit, match="steps"):
        demo.main(["--device", "cpu", "--steps", "-1"])


def test_cli_usage():
    assert cli.main(["--help"]) == 0
    assert cli.main(["nonsense"]) == 2


def test_module_entry_point(monkeypatch, capsys):
    # `python -m fp8train --help`, run in this process (a subprocess cost ~10 s of importing
    # fp8train again, mostly torch._inductor, under make test's load)
    monkeypatch.setattr(sys, "argv", ["fp8train", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("fp8train", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0 and "demo" in capsys.readouterr().out


def test_replot_draws_the_figures_from_report_json(demo_out):
    for png in demo_out.glob("*.png"):
        png.unlink()
    assert demo.main(["--replot", "--out", str(demo_out)]) == []
    assert {p.name for p in demo_out.glob("*.png")} == {"loss.png", "scaling.png", "scaling_fp8_current.png"}


def test_graphed_and_format_options():
    cfg, device = from_args(parser().parse_args(["--device", "cpu"]))
    assert device.type == "cpu" and cfg.graphed is False and cfg.fp8_format is Format.HYBRID and cfg == PRESETS["cpu"]
    assert PRESETS["cuda"].graphed is True and PRESETS["cuda"].fp8_format is Format.HYBRID
    cfg, _ = from_args(parser().parse_args(["--device", "cpu", "--no-graphed", "--fp8-format", "e4m3"]))
    assert cfg.graphed is False and cfg.fp8_format is Format.E4M3
    assert [(name, r.fp8_format if r else None) for name, r in cfg.runs()] == \
        [("bf16", None), ("fp8 delayed", Format.E4M3), ("fp8 current", Format.E4M3)]
    with pytest.raises(SystemExit, match="--graphed needs CUDA"):
        from_args(parser().parse_args(["--device", "cpu", "--graphed"]))
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parser().parse_args(["--fp8-format", "e5m2"])
    with pytest.raises(ValueError, match="fp8_format"):
        DemoConfig(fp8_format="e4m3")
    with pytest.raises(ValueError, match="graphed"):
        DemoConfig(graphed=1)


def test_table_header_names_format_and_graphs(capsys):
    runs = [RunResult(name, None, [(1, 2.0)], [(1, 2.0)], 100.0, 1, 1.0) for name in ("bf16", "fp8 delayed")]
    print_table(runs, torch.device("cuda"), DemoConfig(graphed=True, fp8_format=Format.E4M3))
    header = capsys.readouterr().out.strip().splitlines()[0]
    assert header == "FP8 format e4m3 (e4m3 forward and gradients); training steps replayed from CUDA graphs"


def test_step_plan():
    eager = StepPlan.make(2000, graphed=False, inspect_every=100)
    assert eager.capture_at is None and not any(eager.replays(s) for s in range(2000))
    graphed = StepPlan.make(2000, graphed=True, inspect_every=100)  # the CUDA preset
    assert (graphed.untimed, graphed.capture_at) == (10, 5)
    assert [s for s in range(12) if not graphed.replays(s)] == [0, 1, 2, 3, 4]
    assert [s for s in range(2000) if s >= 5 and not graphed.replays(s)] == list(range(100, 2000, 100))
    assert [s for s in range(2000) if not graphed.timed(s)] == list(range(10)) + list(range(100, 2000, 100))
    short = StepPlan.make(30, graphed=True, inspect_every=10)
    assert (short.untimed, short.capture_at) == (6, 3)
    assert StepPlan.make(1, graphed=True).capture_at is None  # one step: nothing to replay
    assert StepPlan.make(2, graphed=True).capture_at == 1  # at least one eager step first (FP8 calibrates)
    assert not StepPlan.make(30, graphed=True).inspecting(0)  # the BF16 run inspects nothing
    with pytest.raises(ValueError, match="capture_at"):
        StepPlan(10, 2, 0, None)


class StandInGraphs:
    """The capture on CPU, where CUDA graphs do not exist: a 'replay' runs the captured
    module's forward eagerly inside the recipe's FP8 region (as fp8train's graph holds the
    region), and records the tensors it was called with and the batch they held."""

    def __init__(self):
        self.static, self.calls, self.batches = None, [], []

    def __call__(self, module, static, recipe):
        self.static = static
        forward = module.forward

        def replay(x, y):
            self.calls.append((x, y))
            self.batches.append(x.clone())
            with fp8_region(recipe):
                return forward(x, y)
        module.forward = replay


@pytest.fixture(scope="module")
def small_corpus():
    return ByteCorpus.from_stdlib(max_bytes=300_000)


def test_graphed_loop_trains_like_the_eager_loop(small_corpus, tmp_path):
    # The demo's loop with graphs stood in for: the same losses, weights, scaling state and
    # numerics records as the eager loop, bit for bit; replays on the plan's steps only, each
    # called with the static buffers holding that step's batch (a missed copy, a replayed
    # inspection step or a lost FP8 region would change the numbers).
    cfg = DemoConfig(steps=12, batch_size=2, seq_len=32, warmup=2, eval_every=5, inspect_every=4, log_every=5)
    recipe = DelayedScaling()
    torch.manual_seed(0)
    base = GPT(cfg.gpt_config())
    gen = torch.Generator().manual_seed(1)
    val = [small_corpus.batch("val", cfg.batch_size, cfg.seq_len, gen) for _ in range(2)]
    runs = {}
    for graphed in (False, True):
        model, graphs, out = copy.deepcopy(base), StandInGraphs(), tmp_path / f"graphed_{graphed}"
        out.mkdir()
        result = train_model(model, "fp8 delayed", recipe, small_corpus, val, dataclasses.replace(cfg, graphed=graphed),
                             torch.device("cpu"), out, capture=graphs)
        runs[graphed] = (result, model.state_dict(), load(out / result.numerics_log), graphs)
    (eager, eager_state, eager_log, _), (graphed, graphed_state, graphed_log, graphs) = runs[False], runs[True]

    assert graphed.train_loss == eager.train_loss and graphed.val_loss == eager.val_loss
    assert eager_state.keys() == graphed_state.keys() and any("quantizer" in k for k in eager_state)
    for k in eager_state:
        assert torch.equal(graphed_state[k], eager_state[k]), k
    assert graphed_log == eager_log and {r["step"] for r in graphed_log} == {0, 4, 8}

    plan = StepPlan.make(cfg.steps, graphed=True, inspect_every=cfg.inspect_every)
    replayed = [s for s in range(cfg.steps) if plan.replays(s)]
    assert replayed == [1, 2, 3, 5, 6, 7, 9, 10, 11]
    assert all(x is graphs.static[0] and y is graphs.static[1] for x, y in graphs.calls)
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = [small_corpus.batch("train", cfg.batch_size, cfg.seq_len, gen)[0] for _ in range(cfg.steps)]
    assert len(graphs.batches) == len(replayed)
    assert all(torch.equal(got, batches[s]) for got, s in zip(graphs.batches, replayed))


def test_train_step_capture(small_corpus):
    model = GPT(DemoConfig().gpt_config())
    x, y = small_corpus.batch("train", 2, 32, torch.Generator().manual_seed(0))
    graphs = StandInGraphs()
    step = TrainStep(model, None, capture=graphs)
    assert not step.graphed
    step.capture(x, y)
    assert step.graphed and graphs.static is step.static
    assert torch.equal(step.static[0], x) and step.static[0] is not x  # copies: the graphs own their inputs
    with pytest.raises(RuntimeError, match="captured already"):
        step.capture(x, y)
    step(x, y, eager=True)
    assert not graphs.calls and all(p.grad is not None for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_real_capture_needs_cuda(small_corpus):
    x, y = small_corpus.batch("train", 2, 32, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        TrainStep(GPT(DemoConfig().gpt_config()), DelayedScaling()).capture(x, y)
