"""``compat.scaled_mm``'s input checks: what ``torch._scaled_mm`` refuses on CUDA is refused
on a CPU too (where f8tensor computes the product itself), and for every accepted input the
shape torch.compile traces (the fake kernels) is the shape the product has.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from f8tensor import compat

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 16, 32, 48


def _fp8(*shape: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _args(**change):
    """A legal tensorwise call, (mat1, mat2, scale_a, scale_b, kwargs), with ``change`` applied."""
    call = {
        "mat1": _fp8(M, K),
        "mat2": _fp8(N, K).t(),
        "scale_a": torch.tensor(0.5),
        "scale_b": torch.tensor(2.0),
        "bias": None,
        "out_dtype": torch.bfloat16,
    }
    call.update(change)
    return call


_ONE = torch.tensor(1.0)
REFUSED = [
    # The reproductions: each ran on a CPU before.
    pytest.param(
        _args(mat1=_fp8(2, 8, K)),
        RuntimeError,
        r"mat1 and mat2 must be matrices \(2-D\); got shapes \(2, 8, 32\)",
        id="3d_mat1",
    ),
    pytest.param(
        _args(mat1=torch.randn(M, K, dtype=torch.bfloat16), mat2=torch.randn(K, N, dtype=torch.bfloat16)),
        RuntimeError,
        r"mat1 and mat2 must be FP8 \(.*\); got torch.bfloat16 and torch.bfloat16",
        id="bf16_operands",
    ),
    pytest.param(
        _args(scale_a=_ONE.bfloat16(), scale_b=_ONE.bfloat16()),
        ValueError,
        r"scale_a and scale_b must be float32; got torch.bfloat16 and torch.bfloat16",
        id="bf16_scales",
    ),
    pytest.param(
        _args(mat2=_fp8(N, 16).t()), RuntimeError, r"cannot be multiplied \(16x32 and 16x48\)", id="k_mismatch"
    ),
    pytest.param(
        _args(mat2=_fp8(N)), RuntimeError, r"must be matrices \(2-D\); got shapes \(16, 32\) and \(48,\)", id="1d_mat2"
    ),
    pytest.param(
        _args(scale_a=torch.ones(M), scale_b=torch.ones(N)),
        ValueError,
        r"Invalid scaling configuration: scale_a \(16,\) and scale_b \(48,\) .* \(16, 1\) and \(1, 48\) \(rowwise\)",
        id="scale_shapes",
    ),
    pytest.param(
        _args(scale_a=torch.ones(M, 1), scale_b=_ONE),
        ValueError,
        r"Invalid scaling configuration: scale_a \(16, 1\)",
        id="rowwise_a_only",
    ),
    pytest.param(
        _args(bias=torch.zeros(M, N, dtype=torch.bfloat16)),
        RuntimeError,
        r"Bias must be size 48 \(N\) but got shape \(16, 48\)",
        id="2d_bias",
    ),
    pytest.param(
        _args(out_dtype=torch.int32), RuntimeError, r"out_dtype must be one of .*; got torch.int32", id="int_out"
    ),
    pytest.param(_args(mat1=_fp8(2, 8, 0), mat2=_fp8(N, 0).t()), RuntimeError, r"must be matrices \(2-D\)", id="3d_k0"),
]


@pytest.mark.parametrize(("call", "error", "match"), REFUSED)
def test_what_cuda_refuses_is_refused_on_a_cpu(call, error, match):
    call = dict(call)
    mat1, mat2, sa, sb = (call.pop(k) for k in ("mat1", "mat2", "scale_a", "scale_b"))
    with pytest.raises(error, match=match):
        compat.scaled_mm(mat1, mat2, sa, sb, **call)


def test_the_cpu_product_op_refuses_what_its_fake_kernel_refuses():
    with pytest.raises(RuntimeError, match=r"must be matrices \(2-D\); got shapes \(2, 8, 32\)"):
        compat.cpu_scaled_mm(_fp8(2, 8, K), _fp8(N, K).t(), _ONE, _ONE)


ACCEPTED = [
    pytest.param(_args(), id="tensorwise"),
    pytest.param(_args(mat2=_fp8(N, K, dtype=E5M2).t(), out_dtype=torch.float32), id="tensorwise_e5m2_fp32_out"),
    pytest.param(_args(bias=torch.randn(N, dtype=torch.bfloat16)), id="tensorwise_bias"),
    pytest.param(_args(scale_a=torch.rand(M, 1) + 0.5, scale_b=torch.rand(1, N) + 0.5), id="rowwise"),
    pytest.param(_args(scale_a=torch.ones(1, 1), scale_b=torch.ones(1)), id="one_element_scales"),
    # The CPU extensions: fnuz operands (oneDNN refuses them), K = 0 (zeros + the bias).
    pytest.param(
        _args(mat1=_fp8(M, K, dtype=torch.float8_e4m3fnuz), mat2=_fp8(N, K, dtype=torch.float8_e5m2fnuz).t()),
        id="fnuz",
    ),
    pytest.param(_args(mat1=_fp8(M, 0), mat2=_fp8(N, 0).t(), bias=torch.randn(N, dtype=torch.bfloat16)), id="k0"),
]


def _call(call):
    call = dict(call)
    mat1, mat2, sa, sb = (call.pop(k) for k in ("mat1", "mat2", "scale_a", "scale_b"))
    return compat.scaled_mm(mat1, mat2, sa, sb, **call)


@pytest.mark.parametrize("call", ACCEPTED)
def test_fake_and_real_shapes_agree(call):
    real = _call(call)
    assert real.shape == (M, N)
    with FakeTensorMode() as mode:
        fake = _call({k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in call.items()})
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def _compiled_shape(index: int) -> None:
    traced: list[torch.Size] = []

    def backend(gm, example_inputs):
        output = next(node for node in gm.graph.nodes if node.op == "output")
        traced.append(output.args[0][0].meta["example_value"].shape)
        return gm.forward

    call = ACCEPTED[index].values[0]
    torch._dynamo.reset()
    compiled = torch.compile(_call, backend=backend, fullgraph=True)
    out = compiled(call)
    assert traced == [out.shape] and out.shape == (M, N), (traced, out.shape)
    assert torch.equal(out, _call(call))


def test_compiled_graph_shape_is_the_real_shape():
    # In a fresh process: the suite's rules check wraps torch._scaled_mm, and dynamo's table of
    # torch functions, built at the first compile, then lacks the op that compat calls.
    code = (
        f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); import test_compat_scaled_mm as t\n"
        "for i in range(len(t.ACCEPTED)): t._compiled_shape(i)\nprint('ok', len(t.ACCEPTED))"
    )
    env = {**os.environ, "F8TENSOR_CHECK_CUDA_RULES": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == f"ok {len(ACCEPTED)}", done.stderr[-3000:]


def test_is_exporting_only_under_export():
    # torch 2.11's dynamo traced torch.compiler.is_exporting() as True under torch.compile, so
    # a compiled CPU rowwise product went to the CPU kernel that refuses rowwise scales.
    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if compat.is_exporting() else x - 1

    x = torch.zeros(2)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(Probe(), backend="eager", fullgraph=True)(x), x - 1)
    assert torch.equal(torch.export.export(Probe(), (x,)).module()(x), x + 1)
    assert not compat.is_exporting()
