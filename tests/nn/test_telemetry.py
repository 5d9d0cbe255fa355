"""Cast telemetry: exact counters, the stats dict and table, compile, and the outlier study."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils.checkpoint import checkpoint

import f8tensor
from f8tensor import (
    FORMATS,
    STATS_FIELDS,
    Float8Linear,
    Float8LinearConfig,
    Float8SaturationWarning,
    convert_to_float8_training,
    enable_float8_stats,
    float8_stats,
    format_float8_stats,
    saturation_bound,
)
from f8tensor.quant.scaling import amax_to_scale
from f8tensor.tensor import CAST_STATS_FIELDS, cast_to_float8, cast_to_float8_with_stats

# expecttest is absent from some environments (a GPU machine's stock Python): skip, do not error.
expecttest = pytest.importorskip("expecttest", reason="expecttest is not installed")

E4M3, E5M2, E4M3FNUZ, E5M2FNUZ = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
ROLES = ("input", "weight", "grad_output")
COL = {name: i for i, name in enumerate(CAST_STATS_FIELDS)}
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal keys (in order) and values, NaN equal to NaN."""
    return list(a) == list(b) and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


# ============================================================== counters on hand-built tensors

# (format, max, spacing of the top binade, does the tie max + spacing/2 round up out of range?)
# Round-half-to-even: the tie goes to the neighbour with an even mantissa. 448 = 1.110b * 2^8
# is even, so 464 rounds down to it; 57344 = 1.11b * 2^15 and 240 = 1.111b * 2^7 are odd.
TOP = [
    (E4M3, 448.0, 32.0, False),
    (E5M2, 57344.0, 8192.0, True),
    (E4M3FNUZ, 240.0, 16.0, True),
    (E5M2FNUZ, 57344.0, 8192.0, True),
]


@pytest.mark.parametrize("dtype, fmax, ulp, tie_saturates", TOP, ids=lambda v: str(v).removeprefix("torch.float8_"))
def test_saturation_bound(dtype, fmax, ulp, tie_saturates):
    assert FORMATS[dtype].max == fmax
    tie = torch.tensor(fmax + ulp / 2, dtype=torch.float32)
    below_tie = torch.nextafter(tie, torch.tensor(0.0))
    bound = saturation_bound(dtype)
    assert bound == (float(below_tie) if tie_saturates else float(tie))
    # Never counted: max itself, anything that rounds to max.
    assert fmax < bound and float(below_tie) <= bound


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype, fmax, ulp, tie_saturates", TOP, ids=lambda v: str(v).removeprefix("torch.float8_"))
def test_counters_exact(dtype, fmax, ulp, tie_saturates, hp_dtype):
    sub = FORMATS[dtype].smallest_subnormal
    saturated = [2 * fmax, -2 * fmax, fmax + ulp, -(2.0**100)]  # all round beyond max: 4
    tie = [fmax + ulp / 2]  # saturated only where the tie rounds up
    kept_at_max = [fmax, -fmax, fmax + ulp / 4, -(fmax + ulp / 4)]  # represented by max, not clipped
    underflow = [sub / 4, -sub / 4, sub / 2, 0.375 * sub]  # round to zero (sub/2: the tie goes to 0): 4
    kept_small = [sub, -sub, 0.75 * sub, 1.5 * sub]  # round to a non-zero subnormal
    zeros = [0.0, -0.0]  # zero already: not flushed
    normal = [1.0, -3.0, fmax - ulp]
    values = saturated + tie + kept_at_max + underflow + kept_small + zeros + normal
    hp = torch.tensor(values, dtype=torch.float32).to(hp_dtype)
    assert hp.float().tolist() == values, "every test value is exact in the input dtype"

    f8, stats = cast_to_float8_with_stats(hp, dtype, scale=torch.tensor(1.0))
    n_sat, n_under = 4 + tie_saturates, 4
    assert stats.dtype == torch.float64 and stats.shape == (len(CAST_STATS_FIELDS),)
    assert stats[COL["saturated_count"]].item() == n_sat
    assert stats[COL["underflow_count"]].item() == n_under
    assert stats[COL["numel"]].item() == len(values)
    assert stats[COL["amax"]].item() == 2.0**100
    assert stats[COL["scale"]].item() == 1.0
    assert stats[COL["headroom_log2"]].item() == pytest.approx(math.log2(fmax) - 100)

    # The counters agree with what the cast actually produced.
    data = f8._data.float()
    assert (data[: len(saturated)].abs() == fmax).all()
    assert (data[len(saturated)].abs() == fmax).item()
    start = len(saturated) + len(tie) + len(kept_at_max)
    assert (data[start : start + 4] == 0).all() and (data[start + 4 : start + 8] != 0).all()


@pytest.mark.parametrize("dtype, fmax, ulp, tie_saturates", TOP, ids=lambda v: str(v).removeprefix("torch.float8_"))
def test_counters_agree_with_a_reference_quantizer(dtype, fmax, ulp, tie_saturates):
    # Magnitudes over 60 binades, plus a dense band around max and around the smallest
    # subnormal, where the two counters change their mind.
    g = torch.Generator().manual_seed(4)
    sub = FORMATS[dtype].smallest_subnormal
    wide = 2.0 ** (torch.rand(4096, generator=g) * 60 - 30)
    near_max = fmax * (0.9 + 0.2 * torch.rand(4096, generator=g))
    near_sub = sub * 2 * torch.rand(4096, generator=g)
    mags = torch.cat([wide, near_max, near_sub, torch.tensor([fmax + ulp / 2, sub / 2, 0.0])])
    hp = mags * torch.where(torch.rand(mags.shape, generator=g) < 0.5, -1.0, 1.0)
    f8, stats = cast_to_float8_with_stats(hp, dtype, scale=torch.tensor(1.0))
    # Saturated: round-to-nearest-even in float64 with the top binade's spacing (no upper
    # exponent limit) lands above max.
    mag64 = hp.abs().double()
    top_binade = mag64 >= 2.0 ** math.floor(math.log2(fmax))
    expected_sat = (top_binade & (torch.round(mag64 / ulp) * ulp > fmax)).sum().item()
    # Underflow: the definition, read off the FP8 bytes.
    expected_under = ((hp != 0) & (f8._data.float() == 0)).sum().item()
    assert expected_sat > 100 and expected_under > 100
    assert stats[COL["saturated_count"]].item() == expected_sat
    assert stats[COL["underflow_count"]].item() == expected_under


def test_nan_and_empty_are_not_counted():
    hp = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    _, stats = cast_to_float8_with_stats(hp, E4M3, scale=torch.tensor(1.0))
    assert stats[COL["saturated_count"]].item() == 0 and stats[COL["underflow_count"]].item() == 0
    assert math.isnan(stats[COL["amax"]].item())

    f8, stats = cast_to_float8_with_stats(torch.empty(0, 16), E4M3)
    assert f8.shape == (0, 16)
    assert stats[: COL["amax"] + 1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rowwise_counters_exact():
    hp = torch.zeros(2, 32)
    hp[0, 0], hp[0, 1:4] = 1.0, 1e-6  # 1e-6 * 448 = 4.5e-4 < 2**-10: three flushed
    hp[1, 0], hp[1, 1] = 100.0, 0.01  # 0.01 * 4.48 = 0.045: kept
    f8, stats = cast_to_float8_with_stats(hp, E4M3, axiswise_dim=1)
    assert stats[COL["saturated_count"]].item() == 0
    assert stats[COL["underflow_count"]].item() == 3
    assert stats[COL["amax"]].item() == 100.0
    # The scale reported for rowwise casts is the smallest row scale (the amax row's).
    assert stats[COL["scale"]].item() == amax_to_scale(torch.tensor(100.0), E4M3).item()
    assert torch.equal(f8._scale.amin(), amax_to_scale(torch.tensor(100.0), E4M3))


def test_dynamic_scaling_never_saturates():
    # 512 independent dynamic scales: amax * scale lands one fp32 ulp above 448 for some of
    # them, which "|x| > max" would count. The rounding-aware bound does not.
    g = torch.Generator().manual_seed(0)
    hp = torch.randn(512, 64, generator=g) * torch.rand(512, 1, generator=g) * 100
    f8, stats = cast_to_float8_with_stats(hp, E4M3, axiswise_dim=1)
    assert stats[COL["saturated_count"]].item() == 0
    assert ((hp * f8._scale).abs() > 448).sum() > 0, "the case this bound exists for did occur"
    assert abs(stats[COL["headroom_log2"]].item()) < 1e-6


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [E4M3, E5M2, E4M3FNUZ, E5M2FNUZ], ids=lambda d: str(d).removeprefix("torch.float8_"))
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"axiswise_dim": 1}, {"power_of_2_scale": True}, {"scale": torch.tensor(3.0)}],
    ids=["dynamic", "rowwise", "pow2", "given_scale"],
)
def test_measuring_cast_is_bitwise_the_plain_cast(dtype, hp_dtype, kwargs):
    hp = (torch.randn(48, 32, generator=torch.Generator().manual_seed(1)) * 50).to(hp_dtype)
    plain = cast_to_float8(hp, dtype, **kwargs)
    measured, _ = cast_to_float8_with_stats(hp, dtype, **kwargs)
    assert torch.equal(_bytes(plain._data), _bytes(measured._data))
    assert torch.equal(plain._scale, measured._scale)
    assert (plain._orig_dtype, plain._axiswise_dim, plain._gemm) == (
        measured._orig_dtype,
        measured._axiswise_dim,
        measured._gemm,
    )


# ============================================================== the layer, the dict, the table


def _model(recipe: str = "tensorwise", stats: bool = True, **enable_kwargs) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
    if stats:
        enable_float8_stats(model, **enable_kwargs)
    return model


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _expected_keys(recipe: str) -> list[str]:
    delayed = recipe == "delayed"
    return [
        f"{layer}/{role}/{field}"
        for layer in ("0", "2")
        for role in ROLES
        for field in STATS_FIELDS + (("amax_history_max",) if delayed else ())
    ]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_keys_are_stable(recipe):
    model = _model(recipe)
    before = float8_stats(model)
    assert list(before) == _expected_keys(recipe)
    assert all(math.isnan(before[f"0/{role}/saturated_frac"]) for role in ROLES)  # nothing measured yet
    for i in range(2):
        _step(model, torch.randn(24, 32))
        after = float8_stats(model)
        assert list(after) == _expected_keys(recipe)
        assert all(isinstance(v, float) and not math.isnan(v) for v in after.values())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _step(compiled, torch.randn(24, 32))
    assert list(float8_stats(compiled)) == _expected_keys(recipe)  # "_orig_mod" is not part of a key

    if recipe == "delayed":
        full = float8_stats(model, history=True)
        n = model[0].config.delayed.history_len
        assert [k for k in full if "/amax_history/" in k][:n] == [f"0/input/amax_history/{i}" for i in range(n)]
        assert full["0/input/amax_history_max"] == model[0].amax_history_input.max().item()


def test_bare_layer_keys_and_values():
    layer = Float8Linear(32, 16, config=Float8LinearConfig(collect_stats=True))
    x = torch.randn(8, 32, requires_grad=True)
    layer(x).sum().backward()
    stats = float8_stats(layer)
    assert list(stats)[: len(STATS_FIELDS)] == [f"input/{f}" for f in STATS_FIELDS]
    assert stats["input/amax"] == x.abs().max().item()
    assert stats["weight/amax"] == layer.weight.abs().max().item()
    assert stats["grad_output/amax"] == 1.0  # d(sum)/dy
    assert stats["input/saturated_count"] == 0.0 and stats["input/saturated_frac"] == 0.0


def test_forward_only_leaves_grad_output_unmeasured():
    model = _model()
    with torch.no_grad():
        model(torch.randn(8, 32))
    stats = float8_stats(model)
    assert not math.isnan(stats["0/input/amax"]) and not math.isnan(stats["0/weight/scale"])
    assert math.isnan(stats["0/grad_output/amax"])


def test_read_is_one_device_copy(monkeypatch):
    model = _model("delayed")
    _step(model, torch.randn(8, 32))
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.shape) or real(self))
    float8_stats(model)
    assert len(calls) == 1


def test_enable_disable_round_trip():
    model = _model(stats=False)
    assert float8_stats(model) == {}
    assert "no FP8 statistics" in format_float8_stats(model)
    keys_off = set(model.state_dict())
    enable_float8_stats(model)
    assert all(m.config.collect_stats and hasattr(m, "float8_stats_grad_output") for m in (model[0], model[2]))
    assert set(model.state_dict()) == keys_off  # telemetry is not part of checkpoints
    model.load_state_dict(model.state_dict())  # strict load with the buffer present
    enable_float8_stats(model, False)
    assert all(not m.config.collect_stats and not any("stats" in b for b in m._buffers) for m in (model[0], model[2]))
    assert float8_stats(model) == {}


def test_config_flag_alone_turns_it_on():
    cfg = Float8LinearConfig.from_recipe("delayed", collect_stats=True)
    model = nn.Sequential(nn.Linear(32, 32))
    convert_to_float8_training(model, config=cfg)
    assert model[0].float8_stats_input.dtype == torch.float64
    _step(model, torch.randn(4, 32))
    assert float8_stats(model)["0/input/amax"] > 0


def test_enable_arguments_are_checked():
    with pytest.raises(ValueError, match="no Float8Linear"):
        enable_float8_stats(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        enable_float8_stats(_model(stats=False), warn_saturation_above=1.5)
    with pytest.raises(TypeError, match="float"):
        enable_float8_stats(_model(stats=False), warn_saturation_above="high")


def test_saturation_warning_once_per_layer():
    model = _model("delayed", warn_saturation_above=0.01)
    quiet = _model("delayed")  # no threshold: never warns
    for m in (model, quiet):
        _step(m, torch.randn(16, 32))
        _step(m, torch.randn(16, 32) * 1000)  # far above the history: the input saturates
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = float8_stats(model)
        float8_stats(model)
        format_float8_stats(model)
        float8_stats(quiet)
    over = {layer for layer in ("0", "2") if any(first[f"{layer}/{r}/saturated_frac"] > 0.01 for r in ROLES)}
    assert "0" in over
    got = [w for w in caught if issubclass(w.category, Float8SaturationWarning)]
    assert sorted(str(w.message).split("'")[1] for w in got) == sorted(over)
    assert "delayed" in str(got[0].message)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_checkpoint_recompute_writes_the_same_numbers(recipe):
    plain, ckpt = _model(recipe), _model(recipe)

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._checkpoint_wrapped_module = inner  # the name torch's checkpoint_wrapper uses

        def forward(self, x):
            return checkpoint(self._checkpoint_wrapped_module, x, use_reentrant=False)

    ckpt[0], ckpt[2] = Checkpointed(ckpt[0]), Checkpointed(ckpt[2])
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(24, 32, generator=g)
        _step(plain, x)
        _step(ckpt, x)
        assert _same(float8_stats(plain), float8_stats(ckpt))


# ============================================================== compile


def _compiled_equals_eager(recipe: str, backend: str) -> None:
    eager, compiled_model = _model(recipe), _model(recipe)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(24, 32, generator=g) * (30.0 if step == 2 else 1.0)  # step 2 saturates (delayed)
        _step(eager, x)
        _step(compiled, x)
        e, c = float8_stats(eager), float8_stats(compiled)
        assert _same(e, c), {k: (e[k], c[k]) for k in e if not _same({k: e[k]}, {k: c[k]})}
    assert counter.frame_count == 1
    if recipe == "delayed":
        assert e["0/input/saturated_count"] > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp"])
def test_compiled_stats_equal_eager(recipe):
    _compiled_equals_eager(recipe, "aot_eager")


def test_inductor_stats_equal_eager():
    # Inductor generates its own fused cast + count kernels: the numbers must not move.
    _compiled_equals_eager("delayed", "inductor")


def _captured_graphs(model: nn.Module) -> list[str]:
    graphs: list[str] = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _step(compiled, torch.randn(24, 32))
    assert len(graphs) == 2, "one forward and one backward graph"
    return graphs


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_stats_off_leaves_the_graph_unchanged(recipe):
    never = _captured_graphs(_model(recipe, stats=False))
    toggled = _model(recipe)
    enable_float8_stats(toggled, False)
    assert _captured_graphs(toggled) == never
    # The headroom's log2 is telemetry's alone: none in the plain graphs, one per cast with it.
    assert not any("aten.log2" in g for g in never)
    on = _captured_graphs(_model(recipe))
    assert [g.count("aten.log2") for g in on] == [4, 2]  # forward: 2 layers x (input, weight)
    assert all(len(a.splitlines()) > len(b.splitlines()) for a, b in zip(on, never))


# ============================================================== the table


class TestTable(expecttest.TestCase):
    def test_table(self):
        stats = {}
        for role, sat, amax, scale, head in (("input", 1, 1880.0, 211.8, -9.795), ("weight", 0, 0.175, 2532.0, 0.0)):
            row = {
                "saturated_frac": sat / 4096,
                "saturated_count": float(sat),
                "underflow_frac": 0.0,
                "underflow_count": 0.0,
                "amax": amax,
                "scale": scale,
                "headroom_log2": head,
                "amax_history_max": amax,
            }
            stats.update({f"layers.1/{role}/{k}": v for k, v in row.items()})
        stats.update({f"layers.1/grad_output/{k}": math.nan for k in STATS_FIELDS})
        self.assertExpectedInline(
            format_float8_stats(stats),
            """\
layer     role          sat %  sat #  uflow %  uflow #   amax  scale  headroom log2  history amax
--------  -----------  ------  -----  -------  -------  -----  -----  -------------  ------------
layers.1  input        0.0244      1   0.0000        0   1880  211.8          -9.79          1880
layers.1  weight       0.0000      0   0.0000        0  0.175   2532           0.00         0.175
layers.1  grad_output       -      -        -        -      -      -              -             -""",
        )


def test_table_from_model_matches_dict():
    model = _model("delayed")
    _step(model, torch.randn(8, 32))
    assert format_float8_stats(model) == format_float8_stats(float8_stats(model))


def test_public_names():
    public = ("enable_float8_stats", "float8_stats", "format_float8_stats", "Float8SaturationWarning", "STATS_FIELDS")
    assert set(public) <= set(f8tensor.__all__)


# ============================================================== the study (tutorial 04, tiny)


def _tutorial():
    name = "f8tensor_tutorial_04"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tutorials" / "04_delayed_vs_dynamic.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def one_thread():
    # Tiny matrices: a second thread only adds overhead (and contention on shared CPUs).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_study_outlier_is_counted_under_delayed_only(one_thread):
    t = _tutorial()
    cfg = t.StudyConfig(steps=24, outlier_step=20, batch=32)
    results = t.run_study(cfg, runs=(t.DELAYED, t.DYNAMIC, t.MIXED))
    key = f"{cfg.layer}/input/saturated_count"
    k = cfg.outlier_step
    # Delayed: the injected element, and nothing else, is clipped at the event.
    assert results[t.DELAYED, False].stats[k][key] == 0
    assert results[t.DELAYED, True].stats[k][key] == 1
    assert results[t.DELAYED, True].stats[k][f"{cfg.layer}/input/headroom_log2"] < -5  # 1000x: about -10
    # Dynamic: never clipped. Switching only that layer to dynamic: not clipped there either.
    assert results[t.DYNAMIC, True].stats[k][key] == 0
    assert results[t.MIXED, True].stats[k][key] == 0
    # Before the event every run is the same with and without the hook.
    for run in (t.DELAYED, t.DYNAMIC, t.MIXED):
        assert results[run, True].losses[:k] == results[run, False].losses[:k]


def test_tutorial_main_writes_its_figure(tmp_path, monkeypatch, capsys, one_thread):
    t = _tutorial()
    monkeypatch.setenv("F8TENSOR_OUT", str(tmp_path))
    numbers = t.main(t.StudyConfig(steps=30, outlier_step=20, batch=32))  # sets one thread too
    assert (tmp_path / "delayed_vs_dynamic.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "Conclusion" in out and "saturated at step 20" in out
    assert numbers[t.DELAYED]["saturated_event"] == 1 and numbers[t.DYNAMIC]["saturated_event"] == 0
