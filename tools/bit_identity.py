"""Bit-identity check: hashes every output, gradient and buffer of a fixed set of runs.

Usage:
    python tools/bit_identity.py --check          compare with tools/bit_identity_baseline.json
    python tools/bit_identity.py --write          write the baseline (only for a deliberate change)
    python tools/bit_identity.py --check --eager  skip the compiled runs (about 10x faster)

The runs, per recipe in ``RECIPES``: a ``Float8Linear`` on a 2-D and a 3-D input (forward,
backward, delayed buffers), a two-layer model with telemetry on, the same steps inside
``reuse_weight_casts`` over two micro-batches, a ``state_dict`` save/load round trip, and the
2-D step under ``torch.compile`` (inductor; aot_eager for FP4). CPU, one thread, torch's deterministic seeds.

A bf16 GEMM's bits depend on the CPU (oneDNN picks the kernel by instruction set): the
digests that come from one (the high-precision weight gradients) are compared only where a
probe GEMM gives the baseline machine's bits, and reported as skipped elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import pathlib
import sys

import torch
from torch import nn

import f8tensor

BASELINE = pathlib.Path(__file__).with_name("bit_identity_baseline.json")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8", "nvfp4", "mxfp4")


def _depends_on_cpu_bf16_gemm(key: str) -> bool:
    """Whether a digest comes from a bf16 GEMM (a weight gradient computed in high precision)."""
    return key.startswith("rowwise_with_gw_hp.") and ".grad." in key and key.endswith("weight")


def _bf16_gemm_probe() -> str:
    """The digest of one bf16 ``g.t() @ x`` of the tool's shapes, on this CPU."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(32, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    return _digest(a.t() @ b)


def _digest(t: torch.Tensor) -> str:
    t = t.detach()
    if isinstance(t, f8tensor.Float8Tensor):
        return _digest(t._data) + ":" + _digest(t._scale)
    t = t.contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1).to(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16] + f"/{tuple(t.shape)}/{t.dtype}"


def _module_state(prefix: str, model: nn.Module, out: dict[str, str]) -> None:
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"{prefix}.grad.{name}"] = _digest(p.grad)
    for name, b in model.named_buffers():
        out.update(_delayed_parts(f"{prefix}.buffer.", name, b))


def _delayed_parts(prefix: str, name: str, b: torch.Tensor) -> dict[str, str]:
    """Digests of a buffer; delayed scaling's two, once one buffer per part, digested as those
    parts under their old names, so the baseline's digests still hold."""
    stem, _, leaf = name.rpartition(".")
    stem = f"{prefix}{stem}." if stem else prefix
    if leaf == "delayed_amax_history":
        roles = ("input", "weight", "grad_output")
        return {f"{stem}amax_history_{role}": _digest(b[i]) for i, role in enumerate(roles)}
    if leaf == "delayed_step":
        calls = b[2:].view(-1, 3)
        return {
            f"{stem}scale_input": _digest(b[0]),
            f"{stem}scale_weight": _digest(b[1]),
            f"{stem}delayed_call_keys": _digest(calls[:, 0]),
            f"{stem}delayed_call_scales": _digest(calls[:, 1:]),
        }
    return {f"{prefix}{name}": _digest(b)}


def _layer(recipe: str, k: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, k, bias=True), nn.GELU(), nn.Linear(k, k, bias=False)).to(torch.bfloat16)
    return f8tensor.convert_to_float8_training(model, config=f8tensor.Float8LinearConfig.from_recipe(recipe))


def _input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[..., 0] = 50.0  # an outlier column: a wrong orientation or scale shows in the bits
    return x.to(torch.bfloat16).requires_grad_(True)


def _step(model: nn.Module, x: torch.Tensor, tag: str, out: dict[str, str]) -> None:
    y = model(x)
    out[f"{tag}.out"] = _digest(y)
    (y.float() ** 2).mean().backward()
    out[f"{tag}.dx"] = _digest(x.grad)
    _module_state(tag, model, out)


def runs(recipe: str, compiled: bool) -> dict[str, str]:
    """The digests of every run for one recipe."""
    out: dict[str, str] = {}
    k = 128
    torch.manual_seed(1234)
    for dims, shape in (("2d", (32, k)), ("3d", (2, 16, k))):
        model = _layer(recipe, k)
        for step in range(2):  # two steps: delayed history and scales move
            _step(model, _input(shape, 10 + step), f"{recipe}.{dims}.step{step}", out)
    # telemetry
    model = f8tensor.enable_float8_stats(_layer(recipe, k))
    _step(model, _input((32, k), 20), f"{recipe}.stats", out)
    stats = f8tensor.float8_stats(model)
    out[f"{recipe}.stats.values"] = hashlib.sha256(json.dumps(sorted(stats.items()), default=str).encode()).hexdigest()[
        :16
    ]
    # reuse_weight_casts over two micro-batches
    model = _layer(recipe, k)
    with f8tensor.reuse_weight_casts(model):
        for mb in range(2):
            _step(model, _input((32, k), 30 + mb), f"{recipe}.reuse.mb{mb}", out)
    # checkpoint round trip: a fresh model loaded from the state dict gives the same step
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = _layer(recipe, k, seed=99)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    _step(fresh, _input((32, k), 40), f"{recipe}.reloaded", out)
    if compiled:
        torch._dynamo.reset()
        model = _layer(recipe, k)
        # inductor's CPU code generator has no FP4 dtype: the FP4 recipes trace with aot_eager
        backend = "aot_eager" if recipe in ("nvfp4", "mxfp4") else "inductor"
        cmodel = torch.compile(model, fullgraph=True, backend=backend)
        for step in range(2):
            _step(cmodel, _input((32, k), 10 + step), f"{recipe}.compiled.step{step}", out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Write or check the baseline; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    parser.add_argument("--eager", action="store_true", help="skip the compiled runs")
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    got: dict[str, str] = {}
    for recipe in args.recipes:
        got.update(runs(recipe, compiled=not args.eager))
    if args.write:
        written = {"torch": torch.__version__, "bf16_gemm_probe": _bf16_gemm_probe(), "digests": got}
        BASELINE.write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} digests to {BASELINE}")
        return 0
    baseline = json.loads(BASELINE.read_text())
    want = baseline["digests"]
    skipped = []
    if baseline.get("bf16_gemm_probe") != _bf16_gemm_probe():
        skipped = [key for key in got if _depends_on_cpu_bf16_gemm(key)]
        print(
            f"skipped {len(skipped)} digests of bf16 GEMMs: this CPU's bf16 GEMM gives other bits than the baseline's"
        )
    diff = [key for key in got if want.get(key) != got[key] and key not in skipped]
    missing = [
        key
        for key in want
        if key not in got and key.split(".")[0] in args.recipes and (not args.eager or ".compiled." not in key)
    ]
    for key in diff:
        print(f"changed: {key}: {want.get(key)} -> {got[key]}")
    for key in missing:
        print(f"missing: {key}")
    print(f"{len(got) - len(diff) - len(skipped)} of {len(got)} digests identical; {len(missing)} missing")
    return 1 if diff or missing else 0


if __name__ == "__main__":
    sys.exit(main())
