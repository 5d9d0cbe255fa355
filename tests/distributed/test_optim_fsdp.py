"""f8tensor.optim.AdamW on FSDP2 (``fully_shard``) DTensor parameters, gloo on CPU.

Each world size is spawned once and runs every scenario (starting a process costs seconds):

- 2 ranks: the step-parity scenarios, a converted model with FP8 all-gather, then a DCP save;
- 3 ranks: the step-parity scenarios, then a DCP load of the 2-rank checkpoint;
- this process (no process group): a DCP load of the 2-rank checkpoint into a plain model.

Parity is checked on the optimizer alone: every rank also runs one process's optimizer on
the full tensors with the same full gradients (set, not computed, so that the order in
which FSDP sums gradients is out of the comparison), and its shard of every parameter and
every state tensor must have the same bits. The weights shard unevenly over 2 and 3 ranks
(67 rows: 34/33 and 23/23/21; 5 rows: 3/2 and 2/2/1) and the 1-row weight leaves empty
shards on every rank but the first.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, run_processes
from torch import nn

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.optim import AdamW

FP8 = torch.float8_e4m3fn
STEPS = 4
KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# (state_dtype, parameter dtype, master_weights)
VARIANTS = {
    "fp32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.float32, None),
    "fp8": (FP8, torch.float32, None),
    "fp8_remainder": (FP8, torch.bfloat16, "remainder"),
    "fp8_stochastic": (FP8, torch.bfloat16, "stochastic"),
}


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # Never run forward in the parity scenarios: only the shapes matter.
    return nn.Sequential(nn.Linear(160, 67), nn.Linear(67, 5), nn.Linear(256, 1)).to(dtype)


def _grad(step: int, index: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + index)
    grad = torch.randn(shape, generator=g)
    # A few large entries per row, so that FP8 blocks have outliers to scale around.
    grad.view(-1)[::97] *= 30.0
    return grad.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _set_grads(model: nn.Module, step: int, mesh=None) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for index, p in enumerate(model.parameters()):
        full = _grad(step, index, p.shape, p.dtype)
        if isinstance(p, DTensor):
            # src_data_rank=None: each rank takes its chunk of the same full tensor (no collective).
            p.grad = distribute_tensor(full, mesh, p.placements, src_data_rank=None)
        else:
            p.grad = full


def _compare(model, opt, ref_model, ref_opt, mesh) -> list[str]:
    """What differs between this rank's shards and one process's full tensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def expected(full, like):
        return distribute_tensor(_bits(full), mesh, like.placements, src_data_rank=None).to_local()

    bad = []
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        if not torch.equal(_bits(p.to_local()), expected(q, p)):
            bad.append(f"param {i}")
        state, ref_state = opt.state[p], ref_opt.state[q]
        if state.keys() != ref_state.keys():
            bad.append(f"param {i}: state keys {sorted(state)} != {sorted(ref_state)}")
            continue
        for key, value in state.items():
            ref = ref_state[key]
            if key == "step":
                if not torch.equal(value, ref):
                    bad.append(f"param {i} step")
                continue
            if not isinstance(value, DTensor) or value.placements != p.placements or value.shape != ref.shape:
                bad.append(f"param {i} {key}: not a DTensor like its parameter ({type(value).__name__})")
            elif type(value.to_local()) is not torch.Tensor or value.dtype != ref.dtype:
                bad.append(f"param {i} {key}: local {type(value.to_local()).__name__} {value.dtype}")
            elif not torch.equal(_bits(value.to_local()), expected(ref, value)):
                bad.append(f"param {i} {key}: bits differ")
    return bad


def _scenario_parity(rank, world, mesh, ctx, *, variant: str) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    state_dtype, dtype, master = VARIANTS[variant]
    kw = dict(KW, state_dtype=state_dtype, master_weights=master)
    model = _shard(_model(dtype), mesh)
    ref_model = _model(dtype)
    opt, ref_opt = AdamW(model.parameters(), **kw), AdamW(ref_model.parameters(), **kw)
    mismatches, collectives = [], []
    for step in range(STEPS):
        _set_grads(model, step, mesh)
        _set_grads(ref_model, step)
        comm = CommDebugMode()
        with comm:
            opt.step()
        collectives.append(comm.get_total_counts())
        ref_opt.step()
        mismatches += [f"step {step}: {m}" for m in _compare(model, opt, ref_model, ref_opt, mesh)]
    return {
        "mismatches": mismatches,
        "collectives": collectives,
        "local_rows": [p.to_local().shape[0] for p in model.parameters() if p.dim() == 2],
    }


def _scenario_float8_all_gather(rank, world, mesh, ctx) -> dict:
    """A converted model with FSDP2 FP8 all-gather trains with FP8 states; the loss of each
    step follows one process's (gradients summed in another order: ulps, not bits)."""
    from f8tensor import Float8AllGatherWeight

    config = Float8LinearConfig.from_recipe("tensorwise", enable_fsdp_float8_all_gather=True)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 48))
        return convert_to_float8_training(model, config=config)

    model = _shard(build(), mesh)
    ref = build()
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=FP8)
    ref_opt = AdamW(ref.parameters(), lr=1e-2, state_dtype=FP8)
    losses, ref_losses = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(world * 8, 64, generator=g), torch.randn(world * 8, 48, generator=g)
        loss = ((model(x[rank * 8 : (rank + 1) * 8]) - y[rank * 8 : (rank + 1) * 8]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_loss = 0.0
        for r in range(world):  # each rank's rows as one micro-batch; FSDP averages the gradients
            part = ((ref(x[r * 8 : (r + 1) * 8]) - y[r * 8 : (r + 1) * 8]) ** 2).mean()
            (part / world).backward()
            ref_loss = part.item() if r == rank else ref_loss
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss)
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "wrapped": [isinstance(w.to_local(), Float8AllGatherWeight) for w in weights],
        "state_dtypes": [opt.state[w]["exp_avg"].dtype for w in weights],
        "state_local_types": [type(opt.state[w]["exp_avg"].to_local()).__name__ for w in weights],
    }


def _train_steps(model, opt, steps, mesh=None, first=0) -> None:
    for step in range(first, first + steps):
        _set_grads(model, step, mesh)
        opt.step()


DCP_KW = dict(KW, state_dtype=FP8, master_weights="remainder")


def _scenario_dcp_save(rank, world, mesh, ctx) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _shard(_model(torch.bfloat16), mesh)
    opt = AdamW(model.parameters(), **DCP_KW)
    _train_steps(model, opt, 2, mesh)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=Path(ctx["checkpoints"]) / f"ranks{world}")
    return {"saved": True}


def _scenario_dcp_load(rank, world, mesh, ctx, *, saved_by: int) -> dict:
    """Load on another rank count, take one more step: one process's third step, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _shard(_model(torch.bfloat16, seed=1), mesh)  # another init: the load must overwrite it
    opt = AdamW(model.parameters(), **DCP_KW)
    msd, osd = get_state_dict(model, opt)  # creates the optimizer state to load into
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=Path(ctx["checkpoints"]) / f"ranks{saved_by}")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _train_steps(model, opt, 1, mesh, first=2)
    ref_model = _model(torch.bfloat16)
    ref_opt = AdamW(ref_model.parameters(), **DCP_KW)
    _train_steps(ref_model, ref_opt, 3)
    return {"mismatches": _compare(model, opt, ref_model, ref_opt, mesh)}


def _scenario_fp8_needs_dim0_shards(rank, world, mesh, ctx) -> dict:
    """A parameter sharded on dim 1 would cut FP8 row blocks: a clear error at the first step."""
    from torch.distributed.tensor import Shard, distribute_tensor

    p = nn.Parameter(distribute_tensor(torch.zeros(8, 256), mesh, [Shard(1)], src_data_rank=None))
    p.grad = distribute_tensor(torch.ones(8, 256), mesh, [Shard(1)], src_data_rank=None)
    try:
        AdamW([p], state_dtype=FP8).step()
    except ValueError as e:
        error = str(e)
    else:
        error = ""
    q = nn.Parameter(distribute_tensor(torch.zeros(8, 256), mesh, [Shard(1)], src_data_rank=None))
    q.grad = distribute_tensor(torch.ones(8, 256), mesh, [Shard(1)], src_data_rank=None)
    AdamW([q], state_dtype=torch.bfloat16).step()  # bf16 states have no blocks: fine
    return {"message": error, "bf16_local": tuple(q.to_local().shape)}


_SCENARIOS = {
    "fp8_needs_dim0_shards": _scenario_fp8_needs_dim0_shards,
    "parity": _scenario_parity,
    "float8_all_gather": _scenario_float8_all_gather,
    "dcp_save": _scenario_dcp_save,
    "dcp_load": _scenario_dcp_load,
}


def _worker(rank: int, world: int, port: int, jobs: list, ctx: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for key, scenario, kwargs in jobs:
        try:
            results[key] = _SCENARIOS[scenario](rank, world, mesh, ctx, **kwargs)
        except Exception:  # noqa: BLE001  (recorded for the test that reads this result)
            results[key] = {"error": traceback.format_exc()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    gc.collect()  # free FSDP's reference cycles before the process group goes
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, jobs: list, out_dir: Path, checkpoints: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = {"checkpoints": str(checkpoints)}
    # A hang guard, not a speed limit (about 20 s on an idle 2-core machine).
    run_processes(_worker, world, (world, free_port(), jobs, ctx, str(out_dir)), timeout_s=300)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


_PARITY_JOBS = [(f"parity_{v}", "parity", {"variant": v}) for v in VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("optim_checkpoints")


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory, checkpoints):
    jobs = _PARITY_JOBS + [
        ("float8_all_gather", "float8_all_gather", {}),
        ("dcp_save", "dcp_save", {}),
        ("fp8_needs_dim0_shards", "fp8_needs_dim0_shards", {}),
    ]
    return _launch(2, jobs, tmp_path_factory.mktemp("optim_ranks2"), checkpoints)


@pytest.fixture(scope="module")
def ranks3(tmp_path_factory, checkpoints, ranks2):
    jobs = _PARITY_JOBS + [("dcp_load", "dcp_load", {"saved_by": 2})]
    return _launch(3, jobs, tmp_path_factory.mktemp("optim_ranks3"), checkpoints)


@pytest.fixture(params=[2, 3], ids=["ranks2", "ranks3"])
def run(request):
    return request.getfixturevalue(f"ranks{request.param}")


def _results(run: list, key: str) -> list[dict]:
    per_rank = [r.get(key, {"error": "no result (the run stopped before this scenario)"}) for r in run]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"rank {rank}, scenario {key}:\n{res['error']}")
    return per_rank


@pytest.mark.distributed
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_step_equals_one_process_bit_for_bit(run, variant):
    """Every state dtype, 8-bit included: the FP8 blocks run along dim-0 rows, which a dim-0
    shard never cuts, and stochastic rounding (of the moments, of bf16 parameters) draws
    from each element's global index."""
    res = _results(run, f"parity_{variant}")
    world = len(run)
    for rank, r in enumerate(res):
        assert r["mismatches"] == [], (rank, r["mismatches"][:5])
        assert r["collectives"] == [0] * STEPS, (rank, r["collectives"])
    rows = [r["local_rows"] for r in res]
    expected = {2: [[34, 3, 1], [33, 2, 0]], 3: [[23, 2, 1], [23, 2, 0], [21, 1, 0]]}[world]
    assert rows == expected  # uneven shards and empty ones were exercised


@pytest.mark.distributed
def test_float8_all_gather_model_trains_with_fp8_states(ranks2):
    res = _results(ranks2, "float8_all_gather")
    for r in res:
        assert all(r["wrapped"]), r["wrapped"]
        assert r["state_dtypes"] == [FP8, FP8]
        assert r["state_local_types"] == ["Tensor", "Tensor"]  # plain moments, not weight wrappers
        # The gradients are summed in another order than one process's: measured relative
        # differences up to 2e-7 on the losses of 3 steps.
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (r["losses"], r["ref_losses"])
        assert r["losses"][-1] < r["losses"][0]


@pytest.mark.distributed
def test_dcp_checkpoint_from_2_ranks_resumes_on_3_bit_for_bit(ranks3):
    for rank, r in enumerate(_results(ranks3, "dcp_load")):
        assert r["mismatches"] == [], (rank, r["mismatches"][:5])


@pytest.mark.distributed
def test_dcp_checkpoint_from_2_ranks_resumes_in_one_process_bit_for_bit(ranks2, checkpoints):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    assert _results(ranks2, "dcp_save")[0]["saved"]
    model = _model(torch.bfloat16, seed=1)
    opt = AdamW(model.parameters(), **DCP_KW)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoints / "ranks2")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _train_steps(model, opt, 1, first=2)
    ref_model = _model(torch.bfloat16)
    ref_opt = AdamW(ref_model.parameters(), **DCP_KW)
    _train_steps(ref_model, ref_opt, 3)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(_bits(p), _bits(q))
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for key, value in ref_opt.state[q].items():
            assert type(opt.state[p][key]) is torch.Tensor and opt.state[p][key].dtype == value.dtype, key
            assert torch.equal(_bits(opt.state[p][key]), _bits(value)), key


@pytest.mark.distributed
def test_fp8_states_refuse_a_parameter_sharded_on_another_dim(ranks2):
    for res in _results(ranks2, "fp8_needs_dim0_shards"):
        assert "must be sharded on dim 0 or replicated" in res["message"], res["message"]
        assert "state_dtype=torch.float8_e4m3fn" in res["message"] and "Shard(dim=1)" in res["message"]
        assert res["bf16_local"] == (8, 128)
