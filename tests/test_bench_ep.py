"""`dropless bench ep` end to end on 2 CPU devices with the tiny preset: it runs, and its accounting holds."""

import json

import pytest

from dropless.bench import ep
from dropless.core.config import ConfigError


def test_ep_bench_writes_consistent_records(tmp_path, capsys):
    out = tmp_path / "ep-{device}.json"
    assert ep.main(["--preset", "tiny", "--tokens", "32", "--devices", "2", "--strategies", "alltoall",
                    "--skews", "skewed", "--iters", "1", "--profile-iters", "1", "--out", str(out), "--table",
                    "--traces", str(tmp_path / "traces")]) == 0
    result = json.loads((tmp_path / "ep-cpu.json").read_text())
    kept = sorted(path.name for path in (tmp_path / "traces").iterdir())
    assert kept == ["alltoall-1-none-skewed.hlo.txt.gz", "alltoall-1-none-skewed.trace.json.gz",
                    "single-device-none-skewed.hlo.txt.gz", "single-device-none-skewed.trace.json.gz"]
    baseline, record = result["records"]
    assert baseline["strategy"] == "single-device" and record["strategy"] == "alltoall"
    assert record["tokens_dropped"] == 0 and record["devices"] == 2
    # deduplicated alltoall sends exactly the rows that must cross: one per (token, other device it needs)
    sent, needed = record["rows_sent_per_device"], record["rows_needed_per_device"]
    assert sent == needed <= record["rows_sent_without_dedup_per_device"]
    assert 0 < record["comm_share"] < 1 and record["weak_scaling_efficiency"] > 0
    for r in (baseline, record):  # both programs' kernel time, by category and costliest instruction
        assert r["kernel_ms"] > 0 and abs(sum(r["kernel_ms_by_category"].values()) - r["kernel_ms"]) < 1e-6
        assert r["top_ops"] and all(op["ms"] > 0 and op["op_name"] for op in r["top_ops"])
    assert baseline["kernel_ms_by_category"]["communication"] == 0 < record["kernel_ms_by_category"]["communication"]
    assert "| alltoall | skewed |" in capsys.readouterr().out


def test_ep_bench_measures_chunked_dispatch_and_xla_options_in_the_same_run(tmp_path, capsys):
    """Chunked dispatch beside whole, each under two XLA options; PGLE, which needs a GPU's kernel costs, says on
    the CPU that it was not applied and times the program as it was."""
    out = tmp_path / "ep.json"
    assert ep.main(["--preset", "tiny", "--tokens", "32", "--devices", "2", "--strategies", "allgather",
                    "--skews", "random", "--chunks", "1,2", "--xla", "latency_hiding_scheduler,pgle", "--iters", "1",
                    "--profile-iters", "1", "--out", str(out), "--table"]) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["strategy"], r.get("chunks"), r.get("xla")) for r in records] == [
        ("single-device", None, "none"), ("single-device", None, "latency_hiding_scheduler"),
        ("allgather", 1, "latency_hiding_scheduler"), ("allgather", 1, "pgle"),
        ("allgather", 2, "latency_hiding_scheduler"), ("allgather", 2, "pgle")]
    # each efficiency is against the one-device program compiled with the same options (PGLE's: without), timed
    # beside it
    assert [r.get("single_device_xla") for r in records[2:]] == ["latency_hiding_scheduler", "none"] * 2
    assert records[2]["rows_sent_per_device"] == records[4]["rows_sent_per_device"]  # the same rows, in two trips
    assert all(r["pgle"].startswith("not applied") for r in records if r.get("xla") == "pgle")
    assert all(r["tokens_dropped"] == 0 for r in records[2:])
    table = capsys.readouterr().out
    assert "| 1 device, latency_hiding_scheduler | random |" in table
    assert "| allgather, 2 chunks, latency_hiding_scheduler |" in table
    assert "| allgather, 2 chunks, pgle (not applied) | random |" in table


def test_ep_bench_refuses_bad_arguments_before_compiling():
    # ConfigError: `dropless bench ep` prints it as its one `dropless: error:` line, exit status 2
    with pytest.raises(ConfigError, match="positive divisors of --tokens 32"):
        ep.main(["--tokens", "32", "--chunks", "3"])
    with pytest.raises(ConfigError, match="choose from none, pgle, latency_hiding_scheduler"):
        ep.main(["--tokens", "32", "--xla", "fast"])


def test_inputs_are_placed_where_the_program_takes_them():
    """A timed call must not start by copying the input to the other devices (that copy is not the layer)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    split = NamedSharding(mesh, P("expert"))
    compiled = jax.jit(lambda x: x * 2, in_shardings=split, out_shardings=split).lower(jnp.ones(8)).compile()
    (placed,) = ep._placed(compiled, (jnp.ones(8),))
    assert placed.sharding.is_equivalent_to(split, 1)


def test_paired_rounds_alternate_the_two_programs_and_take_the_median_ratio():
    """The one-device and the N-device program are timed in alternating batches, so that a drift of the clocks
    over the run reaches both; the efficiency is the median of the rounds' ratios."""
    import jax.numpy as jnp

    calls = []

    def program(name):
        def run():
            calls.append(name)
            return jnp.zeros(())
        return run

    timing = ep.paired_rounds(program("one"), (), program("many"), (), rounds=3, target_s=0.0)
    runs = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert runs == ["one", "many"] * 3
    low, high = timing["efficiency_range"]
    assert timing["rounds"] == len(timing["rounds_ms"]) == 3 and low <= timing["weak_scaling_efficiency"] <= high
    assert timing["layer_ms"] > 0 and timing["single_device_ms"] > 0
