"""dropless.bench.pgle: the profile-guided recompilation's plumbing (the costs themselves need an NVIDIA GPU)."""

import jax
import jax.numpy as jnp

from dropless.bench import pgle


class _Lowered:
    def __init__(self):
        self.options = []

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        return f"compiled {len(self.options)}"


def test_costs_are_saved_and_handed_to_the_scheduler(tmp_path, monkeypatch):
    monkeypatch.setattr(pgle, "instruction_costs", lambda run, directory: (run(), b"costs")[1])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    lowered, calls = _Lowered(), []
    program, status = pgle.recompile(lowered, "first", lambda p: calls.append(p), tmp_path, {"x": 1})
    # the costs are traced on the lowering compiled without CUDA graphs (their kernels name no instruction)
    assert calls == ["compiled 1"] and lowered.options[0] == {"x": 1, "xla_gpu_enable_command_buffer": ""}
    assert program == "compiled 2" and status.startswith("applied")
    path = tmp_path / "pgle_profile.pb"
    assert path.read_bytes() == b"costs"
    assert lowered.options[1] == {"x": 1, "xla_gpu_enable_latency_hiding_scheduler": True,
                                  "xla_gpu_pgle_profile_file_or_directory_path": str(path)}


def test_off_the_gpu_the_program_itself_is_traced(tmp_path, monkeypatch):
    """No CUDA graphs to turn off: the trace runs the compiled program, and only the costs compile again."""
    monkeypatch.setattr(pgle, "instruction_costs", lambda run, directory: (run(), b"costs")[1])
    lowered, calls = _Lowered(), []
    program, status = pgle.recompile(lowered, "first", lambda p: calls.append(p), tmp_path, {"x": 1})
    assert calls == ["first"] and program == "compiled 1" and status.startswith("applied")
    assert lowered.options == [{"x": 1, "xla_gpu_enable_latency_hiding_scheduler": True,
                                "xla_gpu_pgle_profile_file_or_directory_path": str(tmp_path / "pgle_profile.pb")}]


def test_without_costs_the_first_program_is_kept(tmp_path):
    f = jax.jit(lambda x: jnp.sum(x @ x))
    x = jnp.ones((32, 32))
    lowered = f.lower(x)
    compiled = lowered.compile()
    program, status = pgle.recompile(lowered, compiled, lambda c: [c(x) for _ in range(2)][-1], tmp_path)
    assert program is compiled and status == pgle.NOT_APPLIED  # XLA:CPU's trace has no GPU kernels to cost
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # it did trace
