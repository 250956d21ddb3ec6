"""The ``memplan`` command, driven as a subprocess: exit codes, JSON shape, output, one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memplan

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "memplan.tools.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
        check=False,  # the callers check the exit status: several tests expect 2
    )


def run_cli_parallel(*calls: tuple[str, ...], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Several CLI runs at once: each spends most of its time importing torch."""
    env = {**os.environ, "COLUMNS": "100", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen([sys.executable, "-m", "memplan.tools.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
        for args in calls
    ]
    results = []
    for args, proc in zip(calls, procs):
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return results


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The same CLI in this process (for the cheap variations)."""
    from memplan.tools.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert any(line.startswith("hint:") for line in out.stderr.splitlines()), out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory) -> Path:
    """A user's file with a plain factory, a factory with a loss and batch_size, and an untraceable one."""
    path = tmp_path_factory.mktemp("targets") / "models.py"
    path.write_text(textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        def plain():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
            return model, (torch.randn(64, 32),)


        def with_loss(batch_size=64):
            '''A three-layer MLP with its cross-entropy loss.'''
            model, _ = plain()
            x, y = torch.randn(batch_size, 32), torch.randint(0, 10, (batch_size,))
            return model, (x,), lambda logits: F.cross_entropy(logits, y)


        class DataDependent(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                y = self.lin(x)
                if y.sum().item() > 0:
                    return y * 2
                return y


        def untraceable():
            return DataDependent(), (torch.randn(3, 4),)
        """
    ))
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One JSON report of a zoo model, saving the plan."""
    out_dir = tmp_path_factory.mktemp("report")
    plan_path = out_dir / "plan.json"
    out = run_cli("report", "mlp", "--budget", "60%", "--batch-size", "256", "--json", "--save", str(plan_path))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), plan_path


@pytest.mark.slow
def test_report_json_shape(report):
    data, _ = report
    s = data["summary"]
    for key in ("param_bytes", "eager_peak", "budget", "planned_peak", "predicted_overhead", "method", "status",
                "gap", "solve_time", "aten_ops"):
        assert key in s, key
    assert s["planned_peak"] <= s["budget"] < s["eager_peak"]
    assert s["budget"] == int(s["eager_peak"] * 0.6)
    assert s["predicted_overhead"] >= 1.0
    modules = data["modules"]
    assert modules and {"module", "kept_bytes", "recomputed_bytes", "offloaded_bytes", "recompute_time"} <= set(modules[0])
    assert any(m["module"].startswith("net.") for m in modules)  # module paths from the capture
    assert sum(m["recomputed_bytes"] for m in modules) > 0
    t = data["timeline"]
    assert max(t["planned"]) == s["planned_peak"] and max(t["eager"]) == s["store_all_peak"]
    assert 0 < t["backward_start"] < 1


def test_saved_plan_is_reused_by_optimize(report):
    data, plan_path = report
    assert data["saved_to"] == str(plan_path)
    from tests.memplan.helpers import build_step

    module, args, kwargs = build_step("mlp", batch_size=256)
    opt = memplan.optimize(module, plan=plan_path, example_inputs=args, example_kwargs=kwargs)
    assert opt.plan.predicted_peak == data["summary"]["planned_peak"]
    assert opt.plan.budget == data["summary"]["budget"]


@pytest.mark.slow
def test_report_tables_and_memory_strip(factory_file):
    out = run_cli("report", f"{factory_file}:with_loss", "--budget", "90%", "--batch-size", "512", "--depth", "1",
                  "--time-limit", "3")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("planned peak", "overhead", "method", "solve time", "saved activations by module", "total",
                   "memory over the step", "forward", "backward", "three-layer MLP"):
        assert needle in text, needle
    strip = [line for line in text.splitlines() if line.startswith(("   eager  ", " planned  "))]
    assert len(strip) == 2 and all(any(ch in line for ch in "▁▂▃▄▅▆▇█") for line in strip)
    # Progress goes to stderr, one closed line per stage.
    assert "capturing forward+backward" in out.stderr and "solving" in out.stderr


def test_plain_factory_in_process(factory_file, capsys):
    code, out, err = run_main(capsys, "report", f"{factory_file}:plain", "--budget", "1GB", "--json", "--quiet")
    assert code == 0, err
    assert err == ""
    assert json.loads(out)["summary"]["budget"] == 10**9


@pytest.mark.slow
def test_sweep_writes_table_json_and_png(tmp_path):
    png = tmp_path / "curve.png"
    out = run_cli("sweep", "mlp", "--batch-size", "256", "--budgets", "100%,70%,min,1kB", "--time-limit", "5",
                  "--out", str(png), "--json", "--quiet")  # (a limit: each budget took up to the solver's 30 s; 3 s met them all here)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    labels = [p["label"] for p in data["points"]]
    assert labels == ["100%", "70%", "min", "1kB"]
    feasible = {p["label"]: p["feasible"] for p in data["points"]}
    assert feasible == {"100%": True, "70%": True, "min": True, "1kB": False}
    by = {p["label"]: p for p in data["points"]}
    assert by["min"]["planned_peak"] <= by["70%"]["planned_peak"] <= by["100%"]["planned_peak"]
    assert by["1kB"]["min_budget"] == by["min"]["budget"]
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000


@pytest.mark.slow
def test_user_errors_are_one_line_with_exit_status_2(factory_file):
    unknown, bad_budget, infeasible, untraceable = run_cli_parallel(
        ("report", "no-such-model", "--budget", "1GB"),
        ("report", "mlp", "--budget", "12 parsecs"),
        ("report", "mlp", "--budget", "1kB"),
        ("report", f"{factory_file}:untraceable", "--budget", "1GB"),
    )
    assert_one_line_error(unknown, "unknown target", "no-such-model")
    assert_one_line_error(bad_budget, "cannot read budget")
    assert_one_line_error(infeasible, "below the smallest plan memplan found")
    assert "--budget" in infeasible.stderr  # the hint says what to ask for
    assert_one_line_error(untraceable, "cannot trace DataDependent", "models.py")


@pytest.mark.parametrize(
    "args, needle",
    [
        (("report", "no_such_pkg.mod:build", "--budget", "1GB"), "unknown target"),
        (("report", "{factory}:nope", "--budget", "1GB"), "has no callable 'nope'"),
        (("report", "{factory}:plain", "--budget", "1GB", "--batch-size", "4"), "takes no batch_size"),
        (("sweep", "mlp", "--budgets", "100%,-5%"), "cannot read budget"),
        (("report", "mlp", "--budget", "0%"), "above 0%"),
        (("report", "mlp", "--budget", "1GB", "--world-size", "4"), "options of --fsdp2"),
        (("report", "mlp", "--budget", "min", "--fsdp2"), "one budget per rank"),
        (("report", "mlp", "--budget", "1GB", "--fsdp2", "--ddp"), "different engines"),
        (("report", "mlp", "--budget", "1GB", "--fsdp2", "--world-size", "0"), "at least one rank"),
        (("report", "mlp", "--budget", "1GB", "--optimizer", "adamw", "--optimizer-state", "host",
          "--host-memory", "10kB"), "of host memory (optimizer state"),
        (("report", "mlp", "--budget", "1GB", "--parameters", "host"), "--parameters host pages"),
        (("report", "mlp", "--budget", "1GB", "--optimizer", "adamw", "--parameters", "device", "--master-weights"),
         "leave out --parameters device"),
        (("report", "mlp", "--budget", "1GB", "--optimizer", "adamw", "--parameters", "host",
          "--host-memory", "10kB"), "of host memory (parameters"),
    ],
)
def test_more_user_errors_in_process(factory_file, capsys, args, needle):
    args = tuple(a.replace("{factory}", str(factory_file)) for a in args)
    code, _, err = run_main(capsys, *args, "--quiet")
    assert code == 2
    assert "Traceback" not in err and err.count("error:") == 1 and "hint:" in err
    assert needle in err


def test_debug_shows_the_traceback(factory_file, capsys):
    from memplan.tools.cli import main

    with pytest.raises(memplan.CaptureError):
        main(["report", f"{factory_file}:untraceable", "--budget", "1GB", "--debug", "--quiet"])


def test_console_script_is_declared():
    scripts = (ROOT / "pyproject.toml").read_text()
    assert 'memplan = "memplan.tools.cli:main"' in scripts


@pytest.mark.slow
def test_report_with_offload_at_the_offload_minimum():
    """``--offload --budget min``: the minimum found with the host link, met by a plan that pages values out,
    and the JSON report lists them; without ``--offload`` the same budget is infeasible."""
    with_host, without = run_cli_parallel(
        ("report", "gpt", "--batch-size", "16", "--budget", "min", "--offload", "--json", "--time-limit", "4"),
        ("report", "gpt", "--batch-size", "16", "--budget", "min", "--json", "--time-limit", "4"),
    )
    assert with_host.returncode == 0, with_host.stderr
    assert without.returncode == 0, without.stderr
    paged, remat = json.loads(with_host.stdout), json.loads(without.stdout)
    assert paged["summary"]["budget"] < remat["summary"]["budget"]
    assert paged["summary"]["planned_peak"] <= paged["summary"]["budget"]
    assert sum(m["offloaded_bytes"] for m in paged["modules"]) > 0
    assert sum(m["offloaded_bytes"] for m in remat["modules"]) == 0


WHOLE_STEP = ("report", "mlp", "--batch-size", "64", "--budget", "90%", "--optimizer", "adamw", "--time-limit", "1",
              "--quiet")


def test_report_json_of_the_whole_step_with_adamw(capsys):
    """``--optimizer adamw --json``: memory by what holds it at the planned peak adds up to the peak, the
    optimizer state on the device is there all step, and the timeline has the update phase."""
    code, out, err = run_main(capsys, *WHOLE_STEP, "--json")
    assert code == 0, err
    data = json.loads(out)
    s, m, t = data["summary"], data["memory"], data["timeline"]
    assert m["updated_params"] > 0
    # Device state (the plan may keep some, or all, of it in host memory instead): there all step.
    assert s["optimizer_state_bytes"] + m["host_optimizer_state_bytes"] > 0
    assert m["at_peak"]["optimizer_state"] == m["most"]["optimizer_state"] == s["optimizer_state_bytes"]
    assert sum(m["at_peak"].values()) == m["peak"] == s["planned_peak"]
    assert t["backward_start"] < t["update_start"] < t["update_end"] <= 1


def test_report_text_of_the_whole_step_with_adamw(capsys):
    """``--optimizer adamw``: the summary and the memory table name the optimizer state (device, and host
    when the plan keeps some there), and the memory strip has an ``updates`` row under the update phase."""
    code, text, err = run_main(capsys, *WHOLE_STEP)
    assert code == 0, err
    lines = text.splitlines()
    summary = [line for line in lines if line.startswith("optimizer state")]
    assert summary and ("on the device" in summary[0]), text
    for needle in ("device memory at the planned peak", "optimizer state (device)", "gradients",
                   "activations, temporaries", "parameters, buffers, inputs", "planned peak"):
        assert needle in text, needle
    if "in host memory" in text:
        assert "optimizer state (host)" in text
    updates = [line for line in lines if line.startswith(" updates  ")]
    assert len(updates) == 1 and "═" in updates[0], text


def test_report_places_the_optimizer_state_where_asked(capsys):
    """``--optimizer-state host``: every parameter's state in host memory, none on the device;
    ``device``: all of it on the device (nothing moved, whatever the budget); without ``--optimizer``
    the option is one clear error."""
    placed = {}
    for where in ("host", "device"):
        code, out, err = run_main(capsys, *WHOLE_STEP[:5], "150%", *WHOLE_STEP[6:], "--optimizer-state", where, "--json")
        assert code == 0, err
        placed[where] = json.loads(out)
    host, device = placed["host"], placed["device"]
    assert host["summary"]["optimizer_state_bytes"] == 0 and host["memory"]["host_state_params"] == host["memory"]["updated_params"]
    assert device["memory"]["host_optimizer_state_bytes"] == 0
    assert host["memory"]["host_optimizer_state_bytes"] == device["summary"]["optimizer_state_bytes"] > 0
    code, _, err = run_main(capsys, "report", "mlp", "--budget", "90%", "--optimizer-state", "host", "--quiet")
    assert code == 2 and "hint: add --optimizer" in err, err


def test_report_without_an_optimizer_has_no_update_phase(report):
    data, _ = report
    m, t = data["memory"], data["timeline"]
    assert m["updated_params"] == 0 and m["at_peak"]["optimizer_state"] == 0
    assert sum(m["at_peak"].values()) == data["summary"]["planned_peak"]
    assert t["update_start"] is None and t["update_end"] is None


def test_report_of_a_rank_inside_ddp_counts_its_buckets(capsys):
    """``--ddp``: DDP's gradient buckets (every trainable parameter's gradient once) are a category
    of their own, there all step, in the planned peak and under the budget; the updates wait for
    every gradient (they step with DDP's averages)."""
    from memplan.models import zoo

    code, out, err = run_main(capsys, *WHOLE_STEP, "--ddp", "--json")
    assert code == 0, err
    data = json.loads(out)
    s, m = data["summary"], data["memory"]
    buckets = sum(p.numel() * p.element_size() for p in zoo.build("mlp", batch_size=64).model.parameters())
    assert m["at_peak"]["engine_buffers"] == m["most"]["engine_buffers"] == buckets
    assert sum(m["at_peak"].values()) == m["peak"] == s["planned_peak"] <= s["budget"]
    assert m["updates_after_backward"]


@pytest.mark.slow
def test_report_of_one_fsdp2_rank_is_planned_run_and_measured_offline(capsys, tmp_path):
    """``--fsdp2 --world-size 4``: one rank of four under memplan.fully_shard in this process (a fake
    process group for the others): a share of plain FSDP2's measured step as the budget, the rank's
    measured peak under it and within 2% of the prediction, FSDP2's holdings as categories (the
    shards a quarter of the parameters), and the memory plot written."""
    from memplan.models import zoo

    plot = tmp_path / "rank.png"
    code, out, err = run_main(capsys, "report", "gpt:tiny", "--budget", "80%", "--optimizer", "adamw", "--fsdp2",
                              "--world-size", "4", "--time-limit", "2", "--json", "--plot", str(plot), "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["world_size"] == 4 and data["budget"] == int(0.8 * data["eager_peak"])
    assert data["measured_peak"] <= data["budget"], data
    assert abs(data["predicted_peak"] - data["measured_peak"]) <= 0.02 * data["measured_peak"], data
    params = sum(p.numel() * p.element_size() for p in zoo.build("gpt", size="tiny").model.parameters())
    shards = data["categories"]["parameter shards"]  # every parameter's shard, the root's too
    assert abs(shards - params / 4) <= 0.05 * params / 4, (shards, params)
    # AdamW's two moments per shard (and a step count per parameter)
    assert 0 <= data["categories"]["optimizer state (shards)"] - 2 * shards <= 0.01 * shards
    assert data["graphs"] and plot.stat().st_size > 0
    # a budget below one rank's smallest split: one error line, a budget to ask for, no traceback
    code, _, err = run_main(capsys, "report", "gpt:tiny", "--budget", "500kB", "--optimizer", "adamw", "--fsdp2",
                            "--world-size", "4", "--time-limit", "1", "--quiet")
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert "smallest split memplan found for one rank of 4" in err and "hint: use --budget" in err, err


def test_report_with_paged_parameters_plans_below_the_parameters_bytes(capsys):
    """``--parameters host``: the parameters live in host memory, so a budget below their bytes is met;
    the JSON report's host memory names them, and the link carries each fetch."""
    import json

    code, out, _ = run_main(capsys, "report", "gpt", "--budget", "400kB", "--optimizer", "adamw", "--parameters",
                            "host", "--time-limit", "3", "--json", "--quiet")
    assert code == 0
    summary = json.loads(out)["summary"]
    assert summary["planned_peak"] <= 400_000 < summary["param_bytes"]
    assert summary["host_memory"]["parameters"] == summary["param_bytes"]
    # Each parameter fetched once a step at least; its gradient out once.
    assert summary["host_traffic"]["to_device"] >= summary["param_bytes"] == summary["host_traffic"]["to_host"]
