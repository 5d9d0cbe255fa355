"""Reference rows, no target: our FP8 speed-ups at shapes others published theirs for,
printed beside the published figure (ratios within this run; the published ones are
theirs, on their hardware).

- TransformerEngine's getting-started layer (hidden 4096, FFN 16384, 32 heads, seq 2048,
  batch 8: LayerNorm, attention, GELU MLP) written in plain PyTorch (TE itself cannot be
  installed on the GPU machine), forward + backward compiled: TE publishes FP8 1.53x its bf16.
- nanochat's d26 MLP GEMM, ``(65536 x 1664) @ (1664 x 6656)`` forward + backward compiled:
  nanochat publishes tensorwise 1.18x.
"""

from __future__ import annotations

from .measure import compile_fn, timed_configs
from .runner import Ctx

#: (name, published FP8 / bf16 speed-up, where it is published)
PUBLISHED = {
    "te_layer": (1.53, "TransformerEngine getting-started, FP8 vs bf16"),
    "nanochat_d26_mlp": (1.18, "nanochat d26 MLP GEMM, tensorwise fwd+bwd"),
}
TE_SHAPE, TE_DRY = (4096, 16384, 32, 2048, 8), (64, 256, 2, 32, 2)  # hidden, FFN, heads, seq, batch
NANOCHAT_SHAPE, NANOCHAT_DRY = (65536, 1664, 6656), (256, 64, 128)  # M, K, N
RECIPES = ("bf16", "tensorwise", "rowwise")


def _te_layer(hidden: int, ffn: int, heads: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        """TE's ``TransformerLayer`` in plain PyTorch: pre-LayerNorm attention and GELU MLP."""

        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s, b, _ = x.shape  # TE's (seq, batch, hidden)
            q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, heads, -1).permute(2, 1, 3, 0, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, hidden))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    return Layer()


def references(ctx: Ctx) -> None:
    import _common as C
    import torch
    from torch import nn

    dev = ctx.device
    hidden, ffn, heads, seq, batch = ctx.pick(TE_SHAPE, TE_DRY)
    m, k, n = ctx.pick(NANOCHAT_SHAPE, NANOCHAT_DRY)
    torch.manual_seed(0)
    te_ref = _te_layer(hidden, ffn, heads).to(dev, torch.bfloat16)
    te_x = torch.randn(seq, batch, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mlp_ref = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    mlp_x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mlp_grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    shapes = {
        "te_layer": f"hidden {hidden}, FFN {ffn}, {heads} heads, seq {seq} x batch {batch}",
        "nanochat_d26_mlp": f"{m}x{k}x{n}",
    }

    def step_for(which: str, recipe: str):
        import copy

        ref, x = (te_ref, te_x) if which == "te_layer" else (nn.Sequential(mlp_ref), mlp_x)
        model = ref if recipe == "bf16" else C.f8tensor_convert(copy.deepcopy(ref), recipe)
        run = compile_fn(model)

        def step():
            model.zero_grad(set_to_none=True)
            x.grad = None
            out = run(x)
            (out.float().sum() if which == "te_layer" else out).backward(None if which == "te_layer" else mlp_grad)

        return step

    for which in ("te_layer", "nanochat_d26_mlp"):
        steps = {(recipe, "compiled"): step_for(which, recipe) for recipe in RECIPES}
        warmup, rounds, per_round = ctx.pick((2, 3, 5), (1, 1, 1))
        timings, failed = timed_configs(ctx, steps, warmup, rounds, per_round)
        published, source = PUBLISHED[which]
        base = timings.get(("bf16", "compiled"))
        for (recipe, mode), t in timings.items():
            ratio = base.median / t.median if base else float("nan")
            ctx.row(
                recipe=recipe,
                mode=mode,
                shape=f"{which}: {shapes[which]}",
                metric="step_ms",
                value=t.median,
                unit="ms",
                ratio=ratio,
                detail="" if recipe == "bf16" else f"ours {ratio:.2f}x; published {published:.2f}x ({source})",
            )
        for (recipe, mode), why in failed.items():
            ctx.row(recipe=recipe, mode=mode, shape=which, metric="step_ms", unit="ms", status=f"failed: {why}")
