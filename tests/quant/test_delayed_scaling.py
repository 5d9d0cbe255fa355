"""Delayed scaling in Float8Linear: the amax histories, their reductions and margin, and the
state that lives in module buffers (checkpoint resume, strict loads, recomputation)."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch._dynamo
from helpers import free_port, init_gloo, run_processes
from torch import nn
from torch.utils.checkpoint import checkpoint

from f8tensor import CastConfig, DelayedScalingConfig, Float8Linear, Float8LinearConfig, convert_to_float8_training

from linear_utils import DELAYED_BUFFERS, MLP, assert_sqnr, fp8_copy, grads

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _delayed_layer(history_len=16, reduction="max", margin=0, dim=64) -> Float8Linear:
    config = Float8LinearConfig.from_recipe(
        "delayed", delayed=DelayedScalingConfig(history_len=history_len, reduction=reduction, margin=margin)
    )
    return Float8Linear(dim, 32, config=config)


def _with_amax(amax: float, *shape: int) -> torch.Tensor:
    """Random values in [0, 0.5) with one element equal to ``amax``: max |x| is exactly ``amax``."""
    x = torch.rand(*shape) * 0.5
    x.view(-1)[3] = amax
    return x


def _step(layer: nn.Module, x_amax: float, g_amax: float = 1.0) -> None:
    y = layer(_with_amax(x_amax, 8, 64))
    y.backward(_with_amax(g_amax, *y.shape))


# ----------------------------------------------------------------------------- the history


def test_buffers_are_fp32_and_start_empty():
    layer = _delayed_layer(history_len=5)
    for name in ("amax_history_input", "amax_history_weight", "amax_history_grad_output"):
        buf = getattr(layer, name)
        assert (buf.shape, buf.dtype) == ((5,), torch.float32)
        assert not buf.any()
    for name in ("scale_input", "scale_weight"):
        assert getattr(layer, name).dtype == torch.float32


def test_state_is_two_buffers_with_its_parts_as_views_and_keys():
    # Traced, each buffer is a guard: two per layer; the parts are attributes and state-dict
    # entries under the names they always had.
    layer = _delayed_layer(history_len=4)
    assert set(layer._buffers) == {"delayed_amax_history", "delayed_step"}
    assert set(layer.float8_state()) == set(DELAYED_BUFFERS)
    layer.amax_history_input = torch.arange(4.0)
    layer.scale_weight = torch.tensor(2.0)
    assert torch.equal(layer.delayed_amax_history[0], torch.arange(4.0))
    assert layer.delayed_step[1].item() == 2.0
    state = layer.state_dict()
    assert torch.equal(state["amax_history_input"], torch.arange(4.0)) and state["scale_weight"].item() == 2.0
    # Copies, each its own storage (safetensors refuses views of one): a save holds them apart.
    assert state["amax_history_input"].untyped_storage().data_ptr() != layer.delayed_amax_history.data_ptr()
    assert layer.state_dict(keep_vars=True)["amax_history_input"].data_ptr() == layer.delayed_amax_history.data_ptr()
    with pytest.raises(ValueError, match=r"^amax_history_input takes a tensor of shape \(4,\); got \(5,\)$"):
        layer.amax_history_input = torch.zeros(5)
    with pytest.raises(AttributeError, match="object has no attribute 'scale_input'"):
        Float8Linear(64, 32).scale_input  # noqa: B018


def test_a_layer_pickled_with_a_buffer_per_part_loads_and_trains():
    # Before the two buffers, each part was a buffer of its own (and the calls two more).
    layer = _delayed_layer(history_len=4)
    _step(layer, 2.0)
    want = {name: getattr(layer, name).clone() for name in DELAYED_BUFFERS}
    for name in DELAYED_BUFFERS:
        layer._buffers[name] = want[name].clone()
    layer._buffers["delayed_call_keys"] = torch.full((8,), -1.0)
    layer._buffers["delayed_call_scales"] = torch.ones(8, 2)
    layer._non_persistent_buffers_set.update({"delayed_call_keys", "delayed_call_scales"})
    for name in ("delayed_amax_history", "delayed_step"):
        del layer._buffers[name]
    old = pickle.dumps(layer)
    loaded = pickle.loads(old)
    assert set(loaded._buffers) == {"delayed_amax_history", "delayed_step"}
    for name, value in want.items():
        assert torch.equal(getattr(loaded, name), value), name
    _step(loaded, 1.0)
    assert loaded.amax_history_input.tolist() == [1.0, 2.0, 0.0, 0.0]


def test_history_fills_newest_first_and_rolls_over():
    layer = _delayed_layer(history_len=4)
    w_amax = layer.weight.detach().abs().max()
    for i, amax in enumerate([1.0, 2.0, 3.0], start=1):
        _step(layer, amax, g_amax=10.0 * amax)
    assert layer.amax_history_input.tolist() == [3.0, 2.0, 1.0, 0.0]
    assert layer.amax_history_grad_output.tolist() == [30.0, 20.0, 10.0, 0.0]
    assert torch.equal(layer.amax_history_weight, torch.stack([w_amax] * 3 + [torch.tensor(0.0)]))
    for amax in [4.0, 5.0]:
        _step(layer, amax, g_amax=10.0 * amax)
    assert layer.amax_history_input.tolist() == [5.0, 4.0, 3.0, 2.0]
    assert layer.amax_history_grad_output.tolist() == [50.0, 40.0, 30.0, 20.0]


def test_first_step_casts_with_unit_scale_then_uses_the_history():
    # The scale never depends on the tensor being cast (that is what lets the cast and its
    # amax share one pass): an empty history gives the unit scale, FP8 values equal to the
    # high-precision ones (rounded); the next step scales by the first step's amax.
    layer = _delayed_layer()
    ref = nn.Linear(64, 32)
    ref.load_state_dict(layer.state_dict(), strict=False)
    x = _with_amax(4.0, 8, 64)
    assert_sqnr(ref(x), layer(x), 25.0, "first-step output")
    y = layer(x)
    y.backward(_with_amax(1.0, *y.shape))
    assert layer.scale_input.item() == 1.0
    assert layer.amax_history_input[0].item() == 4.0
    _step(layer, 2.0)
    assert layer.scale_input.item() == E4M3_MAX / 4.0


def test_first_step_inf_is_nan_not_saturated():
    # With the unit scale an inf would saturate to the format's max: it must come out NaN.
    layer = _delayed_layer()
    x = _with_amax(4.0, 8, 64)
    x[0, 0] = float("inf")
    y = layer(x)
    assert y[0].isnan().all()
    assert y[1:].isfinite().all()


@pytest.mark.parametrize(
    ("reduction", "expected_amax"),
    [("max", 4.0), ("most_recent", 1.0)],
)
def test_history_reduction(reduction, expected_amax):
    # Steps with amax 4, then 1; the third step's scale comes from the history [1, 4, 0...]:
    # its max is 4, its most recent entry 1 (the third step's own amax, 2, is not used).
    layer = _delayed_layer(reduction=reduction)
    _step(layer, 4.0)
    _step(layer, 1.0)
    _step(layer, 2.0)
    assert layer.scale_input.item() == E4M3_MAX / expected_amax


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin_leaves_headroom(margin):
    layer = _delayed_layer(margin=margin)
    _step(layer, 4.0)
    _step(layer, 4.0)
    assert layer.scale_input.item() == E4M3_MAX / (4.0 * 2**margin)


def test_non_finite_step_does_not_poison_the_history():
    layer = _delayed_layer(history_len=4)
    _step(layer, 2.0)
    x = _with_amax(3.0, 8, 64)
    x[0, 0] = float("inf")
    y = layer(x)
    assert y.isnan().any()  # an inf input never turns into finite values
    y.backward(torch.ones_like(y))
    assert layer.amax_history_input.tolist() == [2.0, 2.0, 0.0, 0.0]  # newest entry repeated
    _step(layer, 1.0)
    assert layer.amax_history_input.tolist()[0] == 1.0


def test_non_finite_step_repeats_the_newest_when_only_the_input_is_delayed():
    # The weight and grad_output casts are dynamic: their rows stay as they are, and the
    # input's row takes its own newest entry again (pushed row by row, not all three at once).
    dynamic = Float8LinearConfig.from_recipe("tensorwise")
    config = dataclasses.replace(
        dynamic, input=Float8LinearConfig.from_recipe("delayed").input, delayed=DelayedScalingConfig(history_len=4)
    )
    layer = Float8Linear(64, 32, config=config)
    _step(layer, 2.0)
    _step(layer, 1.5)
    x = _with_amax(3.0, 8, 64)
    x[0, 0] = float("inf")
    layer(x).sum().backward()
    assert layer.amax_history_input.tolist() == [1.5, 1.5, 2.0, 0.0]
    assert not layer.amax_history_weight.any() and not layer.amax_history_grad_output.any()


def test_forward_without_backward_leaves_the_history_alone():
    # Evaluation between training steps must not change what the next step does.
    layer = _delayed_layer()
    _step(layer, 2.0)
    before = {name: getattr(layer, name).clone() for name in DELAYED_BUFFERS[:3]}
    with torch.no_grad():
        layer(_with_amax(50.0, 8, 64))
    layer(_with_amax(60.0, 8, 64))  # a graph that is never run backward
    for name, value in before.items():
        assert torch.equal(getattr(layer, name), value), name


# ----------------------------------------------------------------------------- recomputation


def test_activation_checkpointing_pushes_once_per_step():
    base = MLP()
    plain = fp8_copy(base, "delayed")
    ckpt = fp8_copy(base, "delayed")
    for step, amax in enumerate([3.0, 5.0]):
        x = _with_amax(amax, 4, 8, 64)
        plain(x).pow(2).sum().backward()
        checkpoint(ckpt, x, use_reentrant=False).pow(2).sum().backward()
        for name in ("amax_history_input", "amax_history_weight", "amax_history_grad_output"):
            hist = getattr(ckpt.fc1, name)
            assert int((hist != 0).sum()) == step + 1, f"{name}: {hist.tolist()}"
    assert ckpt.fc1.amax_history_input[:3].tolist() == [5.0, 3.0, 0.0]
    for (name, a), b in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_gradient_accumulation_two_forwards_then_two_backwards():
    base = MLP()
    model = fp8_copy(base, "delayed")
    _train(model, 1, start=1)  # a non-empty history, of unit-scale inputs
    pushed = {name: int(getattr(model.fc1, name).count_nonzero()) for name in DELAYED_BUFFERS[:3]}
    # x1 is a bit larger than the history: a per-forward update would change the scale.
    x1, x2 = 1.5 * torch.randn(4, 16, 64), torch.randn(4, 16, 64)

    loss1 = model(x1).pow(2).mean()
    scale_1 = model.fc1.scale_input.clone()
    loss2 = model(x2).pow(2).mean()
    # Both forwards of the step cast with the scale of the history as the step began.
    assert torch.equal(model.fc1.scale_input, scale_1)
    loss1.backward()
    loss2.backward()

    for name, before in pushed.items():  # two backwards: two pushes per history
        assert int(getattr(model.fc1, name).count_nonzero()) == before + 2, name
    # The accumulated gradient is that of the high-precision model.
    ref = copy.deepcopy(base)
    ref.load_state_dict(model.state_dict(), strict=False)
    ref.zero_grad()
    (ref(x1).pow(2).mean() + ref(x2).pow(2).mean()).backward()
    for name, g in grads(ref).items():
        assert_sqnr(g, model.get_parameter(name).grad, 17.0, f"accumulated {name}.grad")


@pytest.mark.parametrize("order", ["first_backward_first", "last_backward_first"])
def test_gradient_accumulation_with_activation_checkpointing(order):
    # The recomputed forwards must cast with the scales the original forwards used,
    # although the backwards between them change the histories.
    base = MLP()
    plain, ckpt = fp8_copy(base, "delayed"), fp8_copy(base, "delayed")
    _train(plain, 1)
    _train(ckpt, 1)
    x1, x2 = 4 * torch.randn(4, 16, 64), torch.randn(4, 16, 64)
    plain_losses = [plain(x).pow(2).mean() for x in (x1, x2)]
    ckpt_losses = [checkpoint(ckpt, x, use_reentrant=False).pow(2).mean() for x in (x1, x2)]
    if order == "last_backward_first":
        plain_losses.reverse()
        ckpt_losses.reverse()
    for a, b in zip(plain_losses, ckpt_losses):
        a.backward()
        b.backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(a, b), name


_DELAYED_ROLES = {
    "all": Float8LinearConfig.from_recipe("delayed"),
    "input_only": Float8LinearConfig(input=CastConfig(torch.float8_e4m3fn, scaling="delayed")),
    "weight_only": Float8LinearConfig(weight=CastConfig(torch.float8_e4m3fn, scaling="delayed")),
}


@pytest.mark.parametrize("roles", list(_DELAYED_ROLES))
def test_interleaved_microbatches_with_activation_checkpointing(roles):
    # One forward, one backward (a pipeline's order): f1 f2 b1 f3 b2 b3. The backward b1
    # changes the histories, so f3 casts with new scales, and b2's recomputed forward must
    # use f2's recorded scales, not the latest call's (f3's): whichever roles are delayed.
    config = _DELAYED_ROLES[roles]
    base = MLP()
    plain, ckpt = (convert_to_float8_training(copy.deepcopy(base), config=config) for _ in range(2))
    _train(plain, 1)
    _train(ckpt, 1)
    xs = [4 * torch.randn(4, 16, 64), torch.randn(4, 16, 64), 0.25 * torch.randn(4, 16, 64)]
    losses = {"plain": [], "ckpt": []}

    def forward(i):
        losses["plain"].append(plain(xs[i]).pow(2).mean())
        losses["ckpt"].append(checkpoint(ckpt, xs[i], use_reentrant=False).pow(2).mean())

    def backward(i):
        losses["plain"][i].backward()
        losses["ckpt"][i].backward()

    forward(0)
    forward(1)
    backward(0)
    forward(2)
    backward(1)
    backward(2)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(a, b), name


def test_an_infinite_delayed_weight_gives_nan_gradients_not_finite_ones():
    # A delayed scale is decided without this step's weight, so an inf in the weight is not
    # caught by the scale: the casts turn it into NaN element by element, in forward and in
    # backward's re-cast (the clamp alone would make it the format's max: finite garbage).
    layer = _delayed_layer()
    _train(nn.Sequential(layer), 1)
    with torch.no_grad():
        layer.weight[3, 5] = float("inf")
    x = torch.randn(8, 64, requires_grad=True)
    y = layer(x)
    y.backward(torch.ones_like(y))
    assert torch.isnan(y[:, 3]).all() and torch.isfinite(y[:, :3]).all()
    assert torch.isnan(x.grad[:, 5]).all() and torch.isfinite(x.grad[:, :5]).all()


# ----------------------------------------------------------------------------- state in buffers


def _train(model: nn.Module, steps: int, start: int = 0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(start, start + steps):
        # Early steps have larger inputs, so the history differs from any one step's amax.
        x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(i)) * (4.0 if i == 0 else 1.0)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _next_step(model: nn.Module):
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1234), requires_grad=True)
    y = model(x)
    y.pow(2).mean().backward()
    return y.detach(), x.grad, grads(model)


def _save_load(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    # The state dict: weights and the persistent delayed parts, not the recorded calls (they
    # link a forward to its recompute within one step only).
    state_b = b.state_dict()
    for name, value in a.state_dict().items():
        assert torch.equal(value, state_b[name]), name


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_checkpoint_resume_is_bit_exact(reduction):
    config_kw = {"delayed": DelayedScalingConfig(history_len=8, reduction=reduction)}
    trained = fp8_copy(MLP(), "delayed", **config_kw)
    _train(trained, 3)
    state = _save_load(trained.state_dict())
    assert state["fc1.amax_history_input"].count_nonzero() == 3

    resumed = fp8_copy(MLP(), "delayed", **config_kw)  # other weights, empty history
    resumed.load_state_dict(state, strict=True)
    _assert_same_state(trained, resumed)

    y_a, gx_a, g_a = _next_step(trained)
    y_b, gx_b, g_b = _next_step(resumed)
    assert torch.equal(y_a, y_b) and torch.equal(gx_a, gx_b)
    for name in g_a:
        assert torch.equal(g_a[name], g_b[name]), name
    _assert_same_state(trained, resumed)

    # The history matters: with only the weights restored, the next step differs.
    params_only = fp8_copy(MLP(), "delayed", **config_kw)
    params_only.load_state_dict({k: v for k, v in state.items() if not k.endswith(DELAYED_BUFFERS)}, strict=True)
    y_c, _, _ = _next_step(params_only)
    assert not torch.equal(y_a, y_c)


def test_compiled_checkpoint_resume_is_bit_exact():
    torch._dynamo.reset()
    trained = fp8_copy(MLP(), "delayed")
    compiled = torch.compile(trained, backend="aot_eager", fullgraph=True)
    _train(compiled, 3)
    assert trained.fc1.amax_history_grad_output.count_nonzero() == 3  # updated by the compiled backward
    state = _save_load(trained.state_dict())

    resumed = fp8_copy(MLP(), "delayed")
    resumed.load_state_dict(state, strict=True)
    resumed_compiled = torch.compile(resumed, backend="aot_eager", fullgraph=True)
    y_a, gx_a, g_a = _next_step(compiled)
    y_b, gx_b, g_b = _next_step(resumed_compiled)
    assert torch.equal(y_a, y_b) and torch.equal(gx_a, gx_b)
    for name in g_a:
        assert torch.equal(g_a[name], g_b[name]), name
    _assert_same_state(trained, resumed)
    torch._dynamo.reset()


def test_strict_load_of_a_plain_linear_checkpoint_starts_fresh_state():
    plain = MLP()
    model = fp8_copy(MLP(), "delayed")
    _train(model, 2)  # the layer has a history of its old weights
    result = model.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model.fc1.weight, plain.fc1.weight)
    for layer in (model.fc1, model.fc2):
        for name in DELAYED_BUFFERS:
            buf = getattr(layer, name)
            assert buf.dtype == torch.float32
            assert torch.equal(buf, torch.ones_like(buf) if name.startswith("scale") else torch.zeros_like(buf)), name
    # ...and trains on from there.
    _train(model, 1)
    assert model.fc1.amax_history_input.count_nonzero() == 1


def test_to_bf16_keeps_delayed_state_fp32():
    # model.to(dtype) casts floating buffers; amax histories and scales must stay fp32.
    model = fp8_copy(MLP(), "delayed").to(torch.bfloat16)
    assert model.fc1.weight.dtype == torch.bfloat16
    for name in DELAYED_BUFFERS:
        assert getattr(model.fc1, name).dtype == torch.float32, name
    plain, ckpt = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    plain(x).float().pow(2).sum().backward()
    checkpoint(ckpt, x, use_reentrant=False).float().pow(2).sum().backward()
    assert torch.equal(plain.fc1.weight.grad, ckpt.fc1.weight.grad)
    assert plain.fc1.weight.grad.dtype == torch.bfloat16


def _load_into_replicated_buffers(rank: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    init_gloo(rank, 1, port)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer, saved = _delayed_layer(), _delayed_layer()
        saved.amax_history_input = torch.arange(16.0)
        for name in ("delayed_amax_history", "delayed_step"):  # as a plan that distributes buffers leaves them
            layer._buffers[name] = distribute_tensor(layer._buffers[name], mesh, [Replicate()])
        layer.load_state_dict(saved.state_dict())
        assert torch.equal(layer.amax_history_input.to_local(), torch.arange(16.0))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_a_state_dict_loads_into_replicated_dtensor_buffers():
    run_processes(_load_into_replicated_buffers, 1, (free_port(),), timeout_s=120)
