"""`dropless.plan.search`: only fitting layouts, fastest first; the fit check and `train.auto_fit`; the refusal of
`dropless train` for a run that does not fit."""

from __future__ import annotations

import jax
import pytest

from dropless import cli
from dropless.core.config import ConfigError, load_preset
from dropless.plan import Cluster, check_fit, make_plan, search
from dropless.plan.search import candidates
from dropless.plan.report import FIT_MARGIN, GIB, layout_overrides
from dropless.train import setup as setup_lib
from tests.micro_config import micro_config

PROXY_ON_ONE = {"train.batch_size": 8}


def test_search_returns_only_fitting_layouts_sorted_by_step_time():
    config = load_preset("deepseek-v3-proxy").replace(**PROXY_ON_ONE)
    cluster = Cluster(1, 8, "H200")
    found = search(config, cluster, device_memory_gib=20)
    assert found
    assert all(p.memory.peak <= (1 - FIT_MARGIN) * 20 * GIB for p in found)
    seconds = [p.time["seconds"] for p in found]
    assert seconds == sorted(seconds)
    # Each line is a valid override set that reproduces its plan.
    best = found[0]
    again = make_plan(config.replace(**dict(kv.split("=") for kv in layout_overrides(best.config).split())),
                      cluster, device_memory_gib=20)
    assert again.memory.peak == best.memory.peak and again.time["seconds"] == best.time["seconds"]
    assert search(config, cluster, device_memory_gib=1) == []


def test_check_fit_refuses_with_the_shortfall_and_a_layout_that_fits():
    config = load_preset("deepseek-v3-proxy").replace(**PROXY_ON_ONE)
    cluster = Cluster(1, 8, "H200")
    usable = f"{(1 - FIT_MARGIN) * 20:.1f}".replace(".", r"\.")
    with pytest.raises(ConfigError, match=rf"GiB over the {usable} GiB usable of H200's 20\.0 GiB .*set parallel\.data=-1 "
                                          r".*train\.auto_fit=true"):
        check_fit(config, cluster, 20)
    fitted = check_fit(config, cluster, 20, auto_fit=True).config
    assert make_plan(fitted, cluster, device_memory_gib=20).fits
    assert check_fit(config, cluster, 1000).config is config
    with pytest.raises(ConfigError, match="no layout of this batch fits"):
        check_fit(config, cluster, 1)


def test_fit_check_on_cpu_against_the_hosts_memory_or_the_limit_and_auto_fit_picks_a_layout(monkeypatch):
    config = micro_config(**{"train.batch_size": 8})
    devices = jax.devices()[:1]
    assert setup_lib.fit_check(config, devices) is config  # fits this host's memory
    need = make_plan(config, Cluster(1, 1, "cpu")).memory.peak / GIB
    with monkeypatch.context() as patched:  # a host too small for it, its memory shared by the process's devices
        patched.setattr(setup_lib, "host_memory_bytes", lambda: int(need * GIB * 0.9))
        with pytest.raises(ConfigError, match=r"the plan does not fit.*usable of cpu's"):
            setup_lib.fit_check(config, devices)
        assert setup_lib.fit_check(config.replace(**{"train.device_memory_gib": need * 1.2}), devices) is not None
    with pytest.raises(ConfigError, match="the plan does not fit"):
        setup_lib.fit_check(config.replace(**{"train.device_memory_gib": need * 0.9}), devices)
    warned = []
    assert setup_lib.fit_check(config.replace(**{"train.device_memory_gib": need * 1.02}), devices,
                               log=warned.append).train.device_memory_gib == need * 1.02
    assert len(warned) == 1 and f"within the model's {FIT_MARGIN:.0%} error" in warned[0]
    printed = []
    fitted = setup_lib.fit_check(config.replace(**{"train.device_memory_gib": need * 0.9, "train.auto_fit": True}),
                                 devices, log=printed.append)
    assert make_plan(fitted, Cluster(1, 1, "cpu"), device_memory_gib=need * 0.9).fits
    assert printed and printed[0].startswith("dropless: train.auto_fit chose parallel.data=-1")


def test_fit_check_on_cpu_shares_the_hosts_memory_among_the_process_s_devices(monkeypatch):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) devices")
    config = micro_config(**{"train.batch_size": 8})
    devices = jax.devices()[:8]
    need = make_plan(config, Cluster(1, 8, "cpu")).memory.peak / GIB  # per device
    monkeypatch.setattr(setup_lib, "host_memory_bytes", lambda: int(8 * need * GIB * 0.9))
    with pytest.raises(ConfigError, match="the plan does not fit"):
        setup_lib.fit_check(config, devices)
    monkeypatch.setattr(setup_lib, "host_memory_bytes", lambda: int(8 * need * GIB * 1.5))
    assert setup_lib.fit_check(config, devices) is config


def test_train_refuses_a_run_that_does_not_fit(tmp_path, capsys):
    status = cli.main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress",
                       "train.device_memory_gib=0.0001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert "the plan does not fit" in err[0] and "GiB over the 0.000094 GiB usable of cpu's 0.0001 GiB (6% kept free)" in err[0]
    assert not (tmp_path / "run").exists()  # refused before the run directory (and its lock) exists


RESUME_KEEPS = frozenset({"train.remat", "train.offload", "train.offload_optimizer", "train.grad_accum_steps",
                          "train.optimizer_moments_dtype", "moe.dispatch"})


def test_train_refuses_with_a_layout_that_fits_and_that_layout_fits(tmp_path, capsys):
    """The refusal names a whole layout line; applied to the same command, it fits (8 CPU devices)."""
    cluster = Cluster(1, len(jax.devices()), "cpu")
    config = load_preset("tiny")
    limit = make_plan(config, cluster).memory.peak / GIB * 0.9
    status = cli.main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress",
                       f"train.device_memory_gib={limit}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "the plan does not fit" in err[0], err
    line = err[0].split("; set ", 1)[1].split(" (predicted peak", 1)[0]
    fixed = config.replace(**dict(kv.split("=", 1) for kv in line.split()))
    assert make_plan(fixed, cluster, device_memory_gib=limit).fits
    assert not (tmp_path / "run").exists()


def test_a_layout_line_replaces_activation_offloading():
    """A line from --search or the refusal sets train.offload too (empty when the layout offloads nothing), so
    that applied after a command that names activations it yields a valid config."""
    config = load_preset("deepseek-v3-proxy").replace(**{**PROXY_ON_ONE, "train.remat": "full",
                                                         "train.offload": "attn_out,moe_in"})
    cluster = Cluster(1, 8, "H200")
    for plan in search(config, cluster, device_memory_gib=20)[:20]:
        line = layout_overrides(plan.config)
        assert " train.offload=" in f" {line}"
        again = config.replace(**dict(kv.split("=", 1) for kv in line.split()))
        assert again.train.offload == plan.config.train.offload and again.train.remat == plan.config.train.remat
    assert any(not p.config.train.offload for p in search(config, cluster, device_memory_gib=20))


def test_auto_fit_on_resume_changes_only_the_mesh():
    """A resumed run may change only parallel.*: with `keep`, auto_fit chooses among meshes, and where no mesh
    fits the refusal says which settings it kept."""
    cluster = Cluster(1, 8, "cpu")
    config = load_preset("tiny")
    need = make_plan(config, cluster).memory.peak / GIB
    fitted = check_fit(config, cluster, need * 0.9, auto_fit=True, keep=RESUME_KEEPS).config
    assert all(getattr(getattr(fitted, k.split(".")[0]), k.split(".")[1])
               == getattr(getattr(config, k.split(".")[0]), k.split(".")[1]) for k in RESUME_KEEPS)
    assert fitted.parallel != config.parallel and make_plan(fitted, cluster, device_memory_gib=need * 0.9).fits
    free = check_fit(config, cluster, need * 0.5, auto_fit=True).config  # without keep another layout fits
    assert free.train.optimizer_moments_dtype != config.train.optimizer_moments_dtype
    with pytest.raises(ConfigError, match="no layout of this batch fits that keeps the run's moe.dispatch, "):
        check_fit(config, cluster, need * 0.5, auto_fit=True, keep=RESUME_KEEPS)


def test_resume_with_auto_fit_changes_only_the_mesh(tmp_path, capsys):
    """`--resume` with `train.auto_fit=true` under a memory limit the saved layout does not meet chooses a mesh that
    fits, keeping every other layout setting of the run (which a resume may not change), and restores the run into
    it. The resume asks for no further step: training on after a change of mesh is
    test_train_checkpoint.py's resume_on_another_mesh."""
    from tests.test_train import SMALL, TRAINED_SCHEDULE

    small = [f"{k}={v}" for k, v in {**SMALL, **TRAINED_SCHEDULE}.items()]
    run = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny", "--run-dir", str(run), "--no-progress", "--steps", "1",
                     *small]) == 0
    config = load_preset("tiny").replace(**SMALL, **TRAINED_SCHEDULE)
    cluster = Cluster(1, len(jax.devices()), "cpu")
    need = make_plan(config, cluster).memory.peak / GIB
    assert search(config, cluster, device_memory_gib=need * 0.9, limit=1)[0].config.train != config.train
    capsys.readouterr()
    status = cli.main(["train", "--resume", "--run-dir", str(run), "--no-progress", "--steps", "1",
                       f"train.device_memory_gib={need * 0.9}", "train.auto_fit=true"])
    out, err = capsys.readouterr()
    assert status == 0 and "the run is already at step 1 of 1" in out, err
    chose = next(line for line in out.splitlines() if "train.auto_fit chose" in line)
    assert "parallel.fsdp=1 " not in chose and "train.optimizer_moments_dtype=float32" in chose
    chosen = dict(setting.split("=") for setting in chose.split("chose ")[1].split())
    assert f"'fsdp': {chosen['parallel.fsdp']}, 'expert': {chosen['parallel.expert']}}}" in out  # restored into it


def test_candidates_cover_every_layout_choice():
    """The search tries each remat mode (with and without offloaded activations), the optimizer state on the device
    and in host memory, both moment dtypes, every microbatch count up to 64, and both exchanges under expert
    parallelism."""
    config = load_preset("deepseek-v3-proxy").replace(**{"train.batch_size": 64 * 8})
    seen = [(c.parallel.expert, c.train.remat, bool(c.train.offload), c.train.offload_optimizer,
             c.train.optimizer_moments_dtype, c.train.grad_accum_steps, c.moe.dispatch)
            for c in candidates(config, Cluster(1, 8, "H200"))]
    assert {s[1:3] for s in seen} == {("none", False), ("moe", False), ("full", False), ("full", True)}
    assert {s[3] for s in seen} == {False, True} and {s[4] for s in seen} == {"float32", "bfloat16"}
    assert max(s[5] for s in seen) == 64 and {1, 2, 4, 8, 16, 32, 64} <= {s[5] for s in seen}
    assert {s[6] for s in seen if s[0] > 1} == {"alltoall", "allgather"} and {s[6] for s in seen if s[0] == 1} == {
        "auto"}


def test_auto_fit_picks_the_fastest_layout_even_when_the_config_fits():
    """train.auto_fit asks for the fastest fitting layout, not merely a fitting one: a config that fits is replaced
    by the search's first plan, and the search lists no two plans that differ only in how `auto` resolved."""
    config = load_preset("deepseek-v3-proxy").replace(**PROXY_ON_ONE)
    cluster = Cluster(1, 8, "H200")
    assert make_plan(config, cluster, device_memory_gib=1000).fits
    found = search(config, cluster, device_memory_gib=1000)
    chosen = check_fit(config, cluster, 1000, auto_fit=True)
    assert chosen.config == found[0].config != config
    assert chosen.time["seconds"] <= make_plan(config, cluster, device_memory_gib=1000).time["seconds"]
    keys = [(p.time["seconds"], p.memory.peak, layout_overrides(p.config).rsplit(" moe.dispatch=", 1)[0])
            for p in found]
    assert len(keys) == len(set(keys))
    for a, b in zip(found, found[1:]):
        assert (a.time["seconds"], a.memory.peak) <= (b.time["seconds"], b.memory.peak)
