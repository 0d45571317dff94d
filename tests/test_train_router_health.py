"""Router health: the balancing dynamics recover a collapsed router, the step's expert shares, the warning line,
and the router's rows in metrics.jsonl, TensorBoard and training.png."""

from __future__ import annotations

import errno
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, ModelConfig, MoEConfig
from dropless.moe.balance import (center_router_bias, input_common_share, input_moments, max_load_ratio,
                                  routing_covariance, routing_gram, routing_moments, token_variance_share,
                                  tokens_per_expert, top_direction_share, update_router_bias)
from dropless.moe.router import route
from dropless.train import metrics as metrics_lib
from dropless.train.step import expert_shares

E, K, D, T = 8, 2, 64, 2048


def collapsed_router(logit_std: float, gap: float = 6.0):
    """Tokens of RMS about 1 sharing one direction (as a residual stream's mean does), a router whose logits
    spread with `logit_std` across tokens (0.02 * sqrt(7168) = 1.7 for DeepSeek-V3's init), and whose expert 0
    is aligned with the shared direction: every token scores expert 0 highest."""
    key_x, key_w = jax.random.split(jax.random.key(0))
    direction = jnp.ones((D,)) / jnp.sqrt(D)
    x_TD = 3.0 * direction + jax.random.normal(key_x, (T, D))
    kernel_DE = logit_std / jnp.sqrt(D) * jax.random.normal(key_w, (D, E))
    return x_TD, kernel_DE.at[:, 0].add(gap * direction)


def bias_dynamics(x_TD, kernel_DE, rate: float, steps: int):
    """The aux-loss-free rule alone, the router's weights fixed: (max/mean load, expert 0's share of the tokens)
    of each step's routing, the bias updated after each."""
    moe = MoEConfig(num_experts=E, num_experts_per_tok=K, score_func="sigmoid", bias_update_rate=rate)

    def step(bias_E, _):
        routing = route(kernel_DE, bias_E, x_TD, moe)
        counts_E = tokens_per_expert(routing.expert_ids_TK, E)
        return update_router_bias(bias_E, counts_E, rate), (max_load_ratio(counts_E), counts_E[0] / T)
    _, (ratios, share_0) = jax.lax.scan(step, jnp.zeros((E,)), None, length=steps)
    return np.asarray(ratios), np.asarray(share_0)


@pytest.mark.parametrize("rate, steps", [(0.01, 300), (0.001, 600)])
def test_balancing_bias_recovers_a_collapsed_router(rate, steps):
    ratios, share_0 = bias_dynamics(*collapsed_router(logit_std=1.7), rate, steps)
    assert share_0[0] > 0.97  # starts collapsed: expert 0 in (nearly) every token's top-K
    recovered = int(np.argmax(ratios <= 1.3)) + 1
    print(f"rate {rate}: max/mean {ratios[0]:.2f} at the start, <= 1.3 from step {recovered}, {ratios[-1]:.2f} at the end")
    assert np.max(ratios[-steps // 4:]) <= 1.3  # recovered, and stays so


def _token_share_reference(values_TE) -> float:
    v = np.asarray(values_TE, np.float64)
    v = v - v.mean(axis=1, keepdims=True)  # a token's common shift changes none of its choices
    per_token = v.var(axis=0).mean()
    return per_token / (per_token + v.mean(axis=0).var())


def _token_share(values_TE) -> float:
    return float(token_variance_share(routing_moments(jnp.asarray(values_TE)), values_TE.shape[0]))


def test_token_variance_share_says_whether_routing_depends_on_the_token():
    rng = np.random.default_rng(0)
    noise_TE, offset_E = rng.normal(size=(T, E)), rng.normal(size=E)
    assert _token_share(noise_TE - noise_TE.mean(0)) == pytest.approx(1.0)
    assert _token_share(np.tile(offset_E, (T, 1))) == pytest.approx(0.0, abs=1e-6)
    # Identical tokens on large offsets: float32 rounding of E[v²] - E[v]² must not give a negative variance (a
    # share below 0) or anything but about 0.
    for scale in (1e3, 1e4, 1e5):
        assert 0.0 <= _token_share(np.tile(scale * offset_E, (T, 1))) < 1e-5
    # A shift per token, however large, leaves every token's ranking the same: collapsed (all choose alike).
    shifted = rng.normal(0, 3.0, size=(T, 1)) + np.linspace(0, 1, E)
    assert _token_share(shifted) < 1e-3
    for scale in (0.1, 1.0, 10.0):
        values = offset_E * scale + noise_TE + rng.normal(0, 2.0, size=(T, 1))
        assert _token_share(values) == pytest.approx(_token_share_reference(values), rel=1e-4)
    # Moments add: two halves of a batch (microbatches, devices) give the whole batch's share.
    values = offset_E + noise_TE
    halves = routing_moments(jnp.asarray(values[: T // 2])) + routing_moments(jnp.asarray(values[T // 2:]))
    assert float(token_variance_share(halves, T)) == pytest.approx(_token_share(values), rel=1e-5)
    # The collapsed router of the bias test: its shared input direction puts a common part in the logits
    # (a low share), which the same router without that expert's alignment does not have.
    x_TD, kernel_DE = collapsed_router(logit_std=1.7)
    _, plain_DE = collapsed_router(logit_std=1.7, gap=0.0)
    collapsed, plain = (_token_share(np.asarray(x_TD @ k)) for k in (kernel_DE, plain_DE))
    assert collapsed < 0.3 < plain


def _top_direction(values_TE) -> float:
    values = jnp.asarray(values_TE)
    return float(top_direction_share(routing_covariance(routing_gram(values), routing_moments(values),
                                                        values.shape[0])))


def _top_direction_reference(values_TE) -> float:
    """float64: each token's values minus their mean over experts, then the covariance over tokens' largest
    eigenvalue over its trace."""
    v = np.asarray(values_TE, np.float64)
    v = v - v.mean(axis=1, keepdims=True)
    eigenvalues = np.linalg.eigvalsh(np.cov(v, rowvar=False, bias=True))
    return eigenvalues[-1] / eigenvalues.sum()


def test_top_direction_share_says_whether_tokens_differ_in_one_way_or_many():
    rng = np.random.default_rng(1)
    noise_TE, offset_E, u_E = rng.normal(size=(T, E)), rng.normal(size=E), rng.normal(size=E)
    # Isotropic per-token values: about 1/(E-1) (the per-token mean over experts is removed: E-1 dimensions).
    assert _top_direction(noise_TE) < 2.5 / (E - 1)
    # Tokens that differ only by a_t along u, on top of any common offset: one direction, whatever the amplitude.
    rank_one = offset_E + rng.normal(0, 3.0, size=(T, 1)) * u_E
    assert _top_direction(rank_one) == pytest.approx(1.0, abs=1e-4)
    # The same on large offsets, where rounding leaves small negative eigenvalues: the share stays within [0, 1].
    far = _top_direction(1e4 * offset_E + rng.normal(0, 1e-2, size=(T, 1)) * u_E)
    assert 0.0 <= far <= 1.0
    assert _token_share(rank_one) > 0.8  # which the token share does not see: the token still moves the logits
    for values in (noise_TE, rank_one + 0.3 * noise_TE, offset_E * 5 + noise_TE * np.linspace(0.1, 2, E)):
        assert _top_direction(values) == pytest.approx(_top_direction_reference(values), rel=1e-4)
    # The sums add: two halves of a batch (microbatches, devices) give the whole batch's share.
    values = jnp.asarray(rank_one + 0.3 * noise_TE)
    halves = [values[: T // 2], values[T // 2:]]
    gram = sum(routing_gram(h) for h in halves)
    moments = sum(routing_moments(h) for h in halves)
    assert float(top_direction_share(routing_covariance(gram, moments, T))) == pytest.approx(_top_direction(values),
                                                                                            rel=1e-5)
    empty = routing_covariance(jnp.zeros((E, E)), jnp.zeros((2, E)), 0)
    assert float(top_direction_share(empty)) == 0.0  # an empty layer: no NaN
    # A diverging step's non-finite values: NaN for that row (the loop's guard reports the step), the others kept.
    covariance = np.stack([np.asarray(routing_covariance(gram, moments, T)), np.full((E, E), np.nan)])
    shares = top_direction_share(covariance)
    assert shares[0] == pytest.approx(_top_direction(values), rel=1e-5) and np.isnan(shares[1])


def test_input_common_share_says_how_alike_the_routers_inputs_are():
    rng = np.random.default_rng(2)
    noise_TD, c_D = rng.normal(size=(T, D)), rng.normal(size=D)

    def share(x_TD):
        return float(input_common_share(input_moments(jnp.asarray(x_TD, jnp.float32)), x_TD.shape[0]))

    def reference(x_TD):  # float64: |mean h|^2 / mean |h|^2
        x = np.asarray(x_TD, np.float64)
        return np.sum(np.square(x.mean(axis=0))) / np.mean(np.sum(np.square(x), axis=1))

    assert share(noise_TD - noise_TD.mean(0)) == pytest.approx(0.0, abs=1e-6)
    assert share(np.tile(c_D, (T, 1))) == pytest.approx(1.0, rel=1e-5)
    for scale in (0.3, 3.0, 30.0):  # the common part outgrowing the tokens' spread: the share rises towards 1
        x = scale * c_D + noise_TD
        assert share(x) == pytest.approx(reference(x), rel=1e-4)
    assert share(0.3 * c_D + noise_TD) < 0.2 < 0.9 < share(30.0 * c_D + noise_TD)
    # The sums add: two halves of a batch (microbatches, devices) give the whole batch's share.
    x = jnp.asarray(3.0 * c_D + noise_TD, jnp.float32)
    halves = input_moments(x[: T // 2]) + input_moments(x[T // 2:])
    assert float(input_common_share(halves, T)) == pytest.approx(share(np.asarray(x)), rel=1e-5)
    assert float(input_common_share(jnp.zeros(D + 1), 0)) == 0.0  # an empty layer: no NaN


def test_token_variance_share_of_an_empty_layer_is_zero_not_nan():
    # A layer that routed no token this step (all its pairs on other devices' experts): zero moments over zero
    # tokens are no routing at all, reported as 0, as the other shares of an empty layer are.
    assert float(token_variance_share(jnp.zeros((2, E)), 0)) == 0.0


def test_routing_covariance_is_symmetric_whatever_the_grams_rounding():
    # Grams summed over microbatches and devices may differ in their mirrored entries by a rounding (a backend's
    # matmul need not compute v_e·v_f and v_f·v_e alike); the covariance the eigensolver reads stays symmetric.
    rng = np.random.default_rng(4)
    values = jnp.asarray(rng.normal(size=(256, E)), jnp.float32)
    gram = np.asarray(routing_gram(values))
    skewed = gram + 1e-3 * np.triu(rng.normal(size=(E, E)), 1)  # upper triangle off by more than a rounding
    covariance = np.asarray(routing_covariance(jnp.asarray(skewed), routing_moments(values), 256))
    np.testing.assert_array_equal(covariance, covariance.T)
    np.testing.assert_allclose(covariance, np.asarray(routing_covariance(jnp.asarray(gram), routing_moments(values),
                                                                         256)), atol=1e-3)


def test_top_direction_share_is_nan_for_a_covariance_with_any_non_finite_entry():
    # One expert's values overflowing makes part of a row's covariance non-finite, maybe only above the diagonal,
    # which the eigensolver does not read: the whole row is NaN, not a share of the finite part.
    covariance = np.stack([np.eye(E), np.eye(E)])
    covariance[1, 0, E - 1] = np.inf
    shares = top_direction_share(covariance)
    assert shares[0] == pytest.approx(1.0 / E) and np.isnan(shares[1])


def test_the_moe_layer_reports_the_selection_scores_and_logits_moments():
    """score_moments are of what selection ranks (the scores plus the bias), logit_moments of the logits."""
    from dropless.moe import init_moe, moe_layer
    from dropless.moe.router import router_logits

    moe = MoEConfig(num_experts=E, num_experts_per_tok=K, score_func="sigmoid", expert_intermediate_size=16,
                    gmm_backend="xla")
    params = init_moe(jax.random.key(1), D, moe, 0.1)
    x_TD, _ = collapsed_router(logit_std=1.7)
    bias_E = jnp.linspace(-0.5, 0.5, E)
    # one program for both biases, not one compilation per operation
    layer = jax.jit(lambda bias_E: moe_layer(params, bias_E, x_TD[None, :256], moe, compute_dtype=jnp.float32))
    _, stats = layer(bias_E)
    logits = np.asarray(router_logits(params["router"]["kernel"], x_TD[:256]), np.float64)
    choice = 1 / (1 + np.exp(-logits)) + np.asarray(bias_E)
    assert int(stats.tokens_routed) == 256
    for moments, values in ((stats.logit_moments, logits), (stats.score_moments, choice)):
        centred = values - values.mean(axis=1, keepdims=True)
        np.testing.assert_allclose(np.asarray(moments), [centred.sum(0), np.square(centred).sum(0)],
                                   rtol=1e-4, atol=1e-3)
    centred = logits - logits.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(stats.logit_gram), centred.T @ centred, rtol=1e-4, atol=1e-3)
    x = np.asarray(x_TD[:256], np.float64)  # the router's input, as it entered the layer
    np.testing.assert_allclose(np.asarray(stats.input_moments), [*x.sum(0), np.square(x).sum()], rtol=1e-4, atol=1e-3)
    unbiased = layer(jnp.zeros(E))[1]
    assert (float(token_variance_share(stats.score_moments, 256))
            < float(token_variance_share(unbiased.score_moments, 256)))


def test_expert_shares_are_the_fraction_of_tokens_per_expert():
    counts_LE = jnp.asarray([[T * K, 0, 0, 0, 0, 0, 0, 0], [T * K // E] * E])
    counts_LE = counts_LE.at[0, 1].set(T).at[0, 0].set(T)  # row 0: every token on experts 0 and 1
    shares = np.asarray(expert_shares(counts_LE, K))
    np.testing.assert_allclose(shares.sum(-1), K)
    np.testing.assert_allclose(shares[0, :2], 1.0)
    np.testing.assert_allclose(shares[1], K / E)
    np.testing.assert_allclose(metrics_lib.load_ratios(shares), [E / K, 1.0])


def test_expert_loads_are_one_when_balanced_and_e_over_k_when_collapsed():
    load, collapsed = metrics_lib.expert_loads([[1.0, 1.0] + [0.0] * (E - 2), [K / E] * E])
    assert collapsed == E / K
    np.testing.assert_allclose(load, [[E / K] * 2 + [0.0] * (E - 2), [1.0] * E])


def test_throughput_is_per_device_and_mfu_uses_the_devices_peak():
    got = metrics_lib.throughput(tokens=8000, seconds=2.0, flops_per_token=1e9, device_count=4, peak_tflops=989.5)
    assert got == pytest.approx({"tokens_per_s": 4000.0, "tflops_per_device": 1.0, "mfu": 1.0 / 989.5})
    assert metrics_lib.throughput(8000, 0.0, 1e9, 4, None) == {"tokens_per_s": 0.0, "tflops_per_device": 0.0,
                                                                "mfu": None}
    assert metrics_lib.device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert metrics_lib.device_peak_tflops("NVIDIA B200 suffix") == 2250.0  # a kind extending a listed name: its peak
    # The longest listed name a kind extends wins, whatever the table's order: NVL parts run below the SXM ones.
    assert metrics_lib.device_peak_tflops("NVIDIA H100 NVL") == metrics_lib.device_peak_tflops("NVIDIA H200 NVL") == 835.5
    assert metrics_lib.device_peak_tflops("NVIDIA H100 PCIe-16GB") == 756.0
    assert metrics_lib.device_peak_tflops("cpu") is None


CONFIG = Config(model=ModelConfig(num_layers=4, first_dense_layers=1, layer_pattern="DMDM", mtp_layers=1),
                moe=MoEConfig(num_experts=E, num_experts_per_tok=K, router_warn_share=0.6, router_warn_logs=3))


def _shares(step: int, collapsed_rows: set[int]) -> list[list[float]]:
    rows = []
    for row in range(3):  # layers 1 and 3, then the MTP block
        share = np.full(E, K / E)
        if row in collapsed_rows:
            share[:] = (K - 0.9) / (E - 1)
            share[5] = 0.9
        rows.append(share.tolist())
    return rows


def test_router_watch_warns_once_per_episode_naming_the_layer():
    watch = metrics_lib.RouterWatch(CONFIG)
    assert metrics_lib.router_row_names(CONFIG) == ["layer 1", "layer 3", "mtp 1"]
    lines = {step: watch.update({"step": step, "expert_share": _shares(step, {1} if step != 50 else set())})
             for step in range(10, 110, 10)}
    assert [step for step, got in lines.items() if got] == [30, 80]  # 3 in a row; again 3 after the dip at 50
    assert lines[30] == ["dropless: warning: layer 3 has sent 90% of its tokens to expert 5 (balanced: 25%) in each "
                         "of the last 3 logged steps, since step 10; the router plots in training.png and "
                         "TensorBoard show every layer (docs/training.md, \"Router health\")."]
    assert watch.update({"step": 0, "loss": 1.0}) == []  # a model without MoE layers logs no shares


def test_router_watch_warns_only_above_the_share():
    watch = metrics_lib.RouterWatch(CONFIG)
    at_the_share = np.full((3, E), (K - 0.6) / (E - 1))
    at_the_share[:, 5] = 0.6  # moe.router_warn_share: not more than it
    assert [watch.update({"step": step, "expert_share": at_the_share}) for step in range(10, 60, 10)] == [[]] * 5


@pytest.mark.parametrize("moe, message", [({"router_warn_share": 0.0}, "moe.router_warn_share=0.0 must be in"),
                                          ({"router_warn_logs": 0}, "moe.router_warn_logs=0 must be > 0")])
def test_bad_router_warning_settings_are_config_errors(moe, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(**moe)


def test_router_rows_reach_metrics_jsonl_tensorboard_and_training_png(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_dict()))
    writer = metrics_lib.MetricsWriter(tmp_path)
    bias = np.linspace(-0.01, 0.01, 3 * E).reshape(3, E)
    for step in range(10, 60, 10):
        writer.write({"step": step, "loss": 5.0 - step / 100, "max_expert_load": 3.6,
                      "expert_share": np.asarray(_shares(step, {0}), np.float32), "router_bias": bias * step,
                      "router_token_share": np.asarray([0.9, 0.5, 0.1]), "router_logit_token_share": [0.8, 0.4, 0.2],
                      "router_logit_top_direction": [0.3, 0.6, 0.99], "router_input_common_share": [0.1, 0.5, 0.9]})
    writer.close()
    records = metrics_lib.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50] and "expert_share" not in records[-1]
    assert records[-1]["router_token_share"] == [0.9, 0.5, 0.1]  # per row, small: they stay in metrics.jsonl
    router = metrics_lib.read_router(tmp_path)
    assert list(router["step"]) == [10, 20, 30, 40, 50]
    # float16: 3 significant digits of each share, and of each bias (a few 1e-5 here)
    np.testing.assert_allclose(router["expert_share"][-1], _shares(50, {0}), rtol=1e-3)
    np.testing.assert_allclose(router["router_bias"][-1], bias * 50, rtol=1e-3, atol=1e-7)
    events = b"".join(f.read_bytes() for f in (tmp_path / "tensorboard").iterdir())
    for tag in (b"router/expert_load", b"router/max_load/row_2", b"router/bias/row_0", b"router/token_share/row_2",
                b"router/logit_token_share/row_0", b"router/logit_top_direction/row_2",
                b"router/input_common_share/row_1"):
        assert tag in events
    assert metrics_lib.plot_run(tmp_path).stat().st_size > 10_000


def test_router_bin_is_the_little_endian_layout_router_json_describes(tmp_path):
    """Tools other than read_router read router.bin from its description: int64 step, then float16 rows."""
    writer = metrics_lib.MetricsWriter(tmp_path)
    shares = np.asarray(_shares(10, {0}))
    writer.write({"step": 10, "expert_share": shares, "router_bias": np.full_like(shares, -0.5)})
    writer.close()
    meta = json.loads((tmp_path / "router.json").read_text())
    assert (meta["rows"], meta["experts"]) == (3, E) and meta["format"].startswith("little-endian records: step int64")
    data, size = (tmp_path / "router.bin").read_bytes(), 3 * E * 2
    assert len(data) == 8 + 2 * size and struct.unpack("<q", data[:8]) == (10,)
    np.testing.assert_array_equal(np.frombuffer(data[8:8 + size], "<f2").reshape(3, E), shares.astype(np.float16))
    np.testing.assert_array_equal(np.frombuffer(data[8 + size:], "<f2"), -0.5)


def test_non_finite_metrics_are_null_in_metrics_jsonl(tmp_path):
    """A diverged step's NaN loss is JSON null, not the NaN token strict JSON readers (jq, JavaScript) refuse; so
    is a NaN in a per-row field (a model whose forward overflows from step 0 logs its router rows so)."""
    writer = metrics_lib.MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": float("nan"), "grad_norm": np.float32(np.inf), "lr": 1e-3,
                  "router_token_share": np.asarray([np.nan, 0.5, -np.inf], np.float32),
                  "max_layer_load": [[1.0, np.nan]]})
    writer.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda token: pytest.fail(f"{token} in metrics.jsonl")) == \
        {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "router_token_share": [None, 0.5, None],
         "max_layer_load": [[1.0, None]]}
    (record,) = metrics_lib.read_metrics(tmp_path)
    assert np.isnan(np.asarray(record["router_token_share"], np.float64)[[0, 2]]).all()  # as the plot reads them


def test_kept_metrics_are_on_disk_before_they_replace_the_old_file(tmp_path, monkeypatch):
    """keep_records_through syncs the new metrics.jsonl before renaming it over the old one: a power cut leaves
    one file or the other, never an empty one."""
    writer = metrics_lib.MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 1.0})
    writer.close()
    calls = []
    real_fsync, real_replace = metrics_lib.os.fsync, metrics_lib.os.replace
    monkeypatch.setattr(metrics_lib.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(metrics_lib.os, "replace", lambda *a: (calls.append("replace"), real_replace(*a))[1])
    assert [r["step"] for r in metrics_lib.keep_records_through(tmp_path, 2)] == [1, 2]
    assert calls == ["fsync", "replace"]


def _tensorboard_events(logdir):
    """Every Event in logdir's event files, read as TensorBoard reads them (TFRecord: length, its CRC, data, CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(logdir.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4
    return events


def test_tensorboard_events_are_on_disk_after_each_record_and_a_refused_write_is_one_error(tmp_path, monkeypatch):
    """Each record's events are flushed when it is written (no writer thread: a dead one would block training),
    and a write the filesystem refuses raises a MetricsError naming the step and the directory."""
    import threading

    threads = threading.active_count()
    writer = metrics_lib.MetricsWriter(tmp_path)
    assert threading.active_count() == threads  # no writer thread whose death could block the training loop
    writer.write({"step": 10, "loss": 4.5, "tokens_per_s": 100.0})
    scalars = {(v.tag, e.step): v.simple_value for e in _tensorboard_events(tmp_path / "tensorboard")
               for v in e.summary.value}
    assert scalars == {("loss", 10): 4.5, ("tokens_per_s", 10): 100.0}

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_lib._TensorBoard, "_add", full_disk)
    with pytest.raises(metrics_lib.MetricsError, match=f"step 20 to {tmp_path}: No space left on device; free space"):
        writer.write({"step": 20, "loss": 4.0})
    writer.close()
    assert [r["step"] for r in metrics_lib.read_metrics(tmp_path)] == [10, 20]


def test_router_history_stays_out_of_metrics_jsonl_and_resumes_with_it(tmp_path):
    """At DeepSeek-V3's 59 router rows x 256 experts a metrics line stays small; a resumed run keeps the router
    records of the steps it does not recompute, and a record torn by a kill is dropped, in both files."""
    rows, experts = 59, 256
    writer = metrics_lib.MetricsWriter(tmp_path)
    rng = np.random.default_rng(0)
    for step in (10, 20, 30):
        writer.write({"step": step, "loss": 1.0, "expert_share": rng.dirichlet(np.ones(experts), rows) * 8,
                      "router_bias": rng.normal(0, 0.1, (rows, experts))})
    writer.close()
    assert max(len(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()) < 1000
    with (tmp_path / "router.bin").open("ab") as torn:
        torn.write(b"\0" * 100)
    assert list(metrics_lib.read_router(tmp_path)["step"]) == [10, 20, 30]
    kept = metrics_lib.keep_records_through(tmp_path, 20)
    assert [r["step"] for r in kept] == [10, 20]
    assert list(metrics_lib.read_router(tmp_path)["step"]) == [10, 20]
    writer = metrics_lib.MetricsWriter(tmp_path)
    writer.write({"step": 30, "loss": 1.0, "expert_share": np.full((rows, experts), 8 / experts),
                  "router_bias": np.zeros((rows, experts))})
    writer.close()
    router = metrics_lib.read_router(tmp_path)
    assert list(router["step"]) == [10, 20, 30] and np.allclose(router["expert_share"][-1], 8 / experts, rtol=1e-3)
    assert (tmp_path / "router.bin").stat().st_size == 3 * router.dtype.itemsize


def test_unreadable_router_header_is_one_clear_error(tmp_path):
    (tmp_path / "router.json").write_text("{not json")
    (tmp_path / "router.bin").write_bytes(b"")
    with pytest.raises(metrics_lib.MetricsError, match="delete it and router.bin"):
        metrics_lib.read_router(tmp_path)


def test_center_router_bias_equalises_the_mean_selection_scores():
    rng = np.random.default_rng(1)
    scores_LTE = jnp.asarray(rng.uniform(size=(3, T, E)) + rng.normal(0, 0.3, size=(3, 1, E)))
    bias_LE = jnp.asarray(rng.normal(0, 0.1, size=(3, E)), jnp.float32)
    moments = jax.vmap(routing_moments)(scores_LTE + bias_LE[:, None])
    tokens = jnp.full((3,), T, jnp.int32)

    def offsets(bias):  # each expert's mean selection score minus the mean over experts, float64
        v = np.asarray(scores_LTE, np.float64) + np.asarray(bias, np.float64)[:, None]
        mean_LE = v.mean(axis=1)
        return mean_LE - mean_LE.mean(axis=1, keepdims=True)

    assert np.abs(offsets(bias_LE)).max() > 0.1
    np.testing.assert_allclose(offsets(center_router_bias(bias_LE, moments, tokens, 1.0)), 0.0, atol=1e-5)
    np.testing.assert_allclose(offsets(center_router_bias(bias_LE, moments, tokens, 0.3)), 0.7 * offsets(bias_LE),
                               atol=1e-5)
    np.testing.assert_array_equal(center_router_bias(bias_LE, moments, tokens, 0.0), bias_LE)
    # A layer that routed no token this step (all of its moments zero) keeps its bias: no 0/0 into it.
    np.testing.assert_array_equal(center_router_bias(bias_LE, jnp.zeros_like(moments), jnp.zeros((3,), jnp.int32),
                                                     1.0), bias_LE)


def herd_dynamics(rate: float, center_rate: float, steps: int = 300):
    """A router whose input is a common direction (RMS 3) that turns a little every step plus a small per-token
    part (RMS 0.1): the logits' per-token share is ~7%, every token ranks the experts alike, and the ranking drifts,
    as the proxy's hidden states do early in training. The router's weights are fixed; the bias rules act after
    each step. Returns each step's max/mean load."""
    key_x, key_w, key_d = jax.random.split(jax.random.key(0), 3)
    per_token_TD = 0.1 * jax.random.normal(key_x, (T, D))
    kernel_DE = 1.7 / jnp.sqrt(D) * jax.random.normal(key_w, (D, E))
    moe = MoEConfig(num_experts=E, num_experts_per_tok=K, score_func="sigmoid", bias_update_rate=rate)

    def turn(d, fresh):
        d = d + 0.05 * fresh
        return d, d / jnp.linalg.norm(d)
    fresh = jax.random.normal(key_d, (steps, D))
    _, directions = jax.lax.scan(turn, fresh[0], fresh)

    def step(bias_E, direction_D):
        routing = route(kernel_DE, bias_E, 3.0 * direction_D + per_token_TD, moe)
        counts_E = tokens_per_expert(routing.expert_ids_TK, E)
        bias_E = center_router_bias(bias_E, routing_moments(routing.choice_TE), T, center_rate)
        return update_router_bias(bias_E, counts_E, rate), max_load_ratio(counts_E)
    _, ratios = jax.lax.scan(step, jnp.zeros((E,)), directions)
    return np.asarray(ratios)


def test_centring_ends_a_drifting_herd_that_the_sign_rule_follows_too_slowly():
    sign_only = herd_dynamics(1e-3, 0.0)
    centred = herd_dynamics(1e-3, 1.0)
    print(f"mean max/mean over steps 50-300: sign rule {sign_only[50:].mean():.2f}, centred {centred[50:].mean():.2f}")
    assert sign_only[0] == centred[0] == pytest.approx(E / K)  # both start with every token on the same K
    assert np.all(sign_only[:20] > 3.5) and sign_only[50:].mean() > 2.2  # the sign rule: a slow chase
    assert np.all(centred[1:] < 3.0) and centred[50:].mean() < 1.5  # centred: no herd after the first update


def _router_record(step, rows=2, experts=8):
    return {"step": step, "loss": 1.0, "expert_share": np.full((rows, experts), 2 / experts),
            "router_bias": np.zeros((rows, experts))}


def test_router_header_is_renamed_into_place_and_checked_when_a_run_reopens(tmp_path, monkeypatch):
    """A kill while the header is written leaves no header or a whole one (written beside, then renamed), so a
    resumed run can always open its router history; a header that is not one, or of another shape, is one clear
    error when the writer reopens it."""
    class Killed(BaseException):
        pass

    def killed(*_):
        raise Killed
    writer = metrics_lib.MetricsWriter(tmp_path)
    monkeypatch.setattr(metrics_lib.os, "replace", killed)
    with pytest.raises(Killed):
        writer.write(_router_record(1))
    monkeypatch.undo()
    assert not (tmp_path / "router.json").exists()
    writer = metrics_lib.MetricsWriter(tmp_path)
    writer.write(_router_record(1))
    writer.close()
    assert json.loads((tmp_path / "router.json").read_text())["experts"] == 8
    writer = metrics_lib.MetricsWriter(tmp_path)
    with pytest.raises(metrics_lib.MetricsError, match="another model's router rows"):
        writer.write(_router_record(2, experts=4))
    (tmp_path / "router.json").write_text("")  # what an unprotected write cut by a kill leaves
    writer = metrics_lib.MetricsWriter(tmp_path)
    with pytest.raises(metrics_lib.MetricsError, match="is not a router header; delete it and router.bin"):
        writer.write(_router_record(2))


def test_a_router_record_torn_by_a_kill_is_dropped_when_the_writer_reopens(tmp_path):
    writer = metrics_lib.MetricsWriter(tmp_path)
    writer.write(_router_record(10))
    writer.close()
    with (tmp_path / "router.bin").open("ab") as torn:
        torn.write(b"\1" * 40)  # part of a 72-byte record
    writer = metrics_lib.MetricsWriter(tmp_path)
    writer.write(_router_record(20))
    writer.close()
    router = metrics_lib.read_router(tmp_path)
    assert list(router["step"]) == [10, 20] and (tmp_path / "router.bin").stat().st_size == 2 * router.dtype.itemsize
