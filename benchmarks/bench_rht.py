"""What the random Hadamard transform does to the NVFP4 weight-gradient product's SQNR.

``grad_W = g.t() @ x`` with both operands cast to NVFP4 in 1x16 blocks along the tokens (the
contraction dim), with and without the 16x16 transform (``f8tensor.quant.hadamard.apply_rht``) on
both, each against the fp64 product. Input classes: Gaussian; a few outlier tokens (3-20x,
in x only, in both at independent tokens, in both at the same tokens); an outlier token in x
and another in g inside every 16-block ("crossed"); Student-t values (heavy tails per
element); per-element outliers; and the inputs and output gradients the demo GPT's linear
layers see after ``--gpt-steps`` bf16 training steps. Mean over ``--seeds`` draws.
Round-to-nearest on both operands, and stochastic rounding of ``g`` as the nvfp4 recipe casts it.

    PYTHONPATH=. python benchmarks/bench_rht.py [--seeds 3] [--gpt-steps 100]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from f8tensor import Float4Tensor, demo
from f8tensor.quant.hadamard import apply_rht

T, D = 1024, 64


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return float(10 * torch.log10(ref.square().sum() / (ref - approx).square().sum()))


def _q(t: torch.Tensor, rounding: str) -> torch.Tensor:
    return Float4Tensor.from_hp(t, "nvfp4", block=(16, 1), pack_dim=0, rounding=rounding).to_hp().double()


def wgrad_sqnr(g: torch.Tensor, x: torch.Tensor, rht: bool, g_rounding: str = "nearest") -> float:
    exact = g.double().t() @ x.double()
    if rht:
        g, x = apply_rht(g, 0), apply_rht(x, 0)
    return sqnr(exact, _q(g.float(), g_rounding).t() @ _q(x.float(), "nearest"))


def _tokens(gen: torch.Generator, every: int) -> torch.Tensor:
    return torch.randperm(T, generator=gen)[: T // every]


def classes() -> dict[str, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    def base(gen):
        return torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)

    out = {"gaussian": base}
    for k in (3, 10, 20):
        for every in (16, 64):

            def x_only(gen, k=k, every=every):
                g, x = base(gen)
                x[_tokens(gen, every)] *= k
                return g, x

            def both(gen, k=k, every=every):
                g, x = base(gen)
                x[_tokens(gen, every)] *= k
                g[_tokens(gen, every)] *= k
                return g, x

            def same(gen, k=k, every=every):
                g, x = base(gen)
                idx = _tokens(gen, every)
                x[idx] *= k
                g[idx] *= k
                return g, x

            out[f"token outliers {k}x, 1 in {every}, x only"] = x_only
            out[f"token outliers {k}x, 1 in {every}, g and x, independent"] = both
            out[f"token outliers {k}x, 1 in {every}, g and x, same tokens"] = same
    for k in (5, 20, 50):

        def crossed(gen, k=k):
            g, x = base(gen)
            x[torch.arange(3, T, 16)] *= k
            g[torch.arange(7, T, 16)] *= k
            return g, x

        out[f"crossed: x token 3 and g token 7 of every block {k}x"] = crossed
    for dof in (3, 5, 8):

        def student(gen, dof=dof, both=True):
            # Student-t: a normal over the root of an independent chi-square / dof (from gen).
            z = torch.randn(2, T, D, generator=gen)
            t = z / (torch.randn(2, T, D, dof, generator=gen).square().sum(-1) / dof).sqrt()
            return (t[0] if both else torch.randn(T, D, generator=gen)), t[1]

        out[f"student-t({dof} dof), g and x"] = student
        out[f"student-t({dof} dof), x only"] = lambda gen, dof=dof: student(gen, dof, both=False)

    def elements(gen, k=20, p=0.01):
        g, x = base(gen)
        x[torch.rand(T, D, generator=gen) < p] *= k
        return g, x

    out["element outliers 20x, p=0.01, x only"] = elements
    return out


def gpt_operands(steps: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(grad_output, input) of every linear layer but lm_head, on the batch after ``steps``
    bf16 training steps of the demo GPT (``small`` size, seed 0)."""
    size = demo.SIZES["small"]
    torch.manual_seed(0)
    model = demo.GPT(size)
    data = demo.load_corpus(torch.device("cpu"))
    starts = demo.batch_starts(len(data), steps + 1, size.batch_size, size.seq_len, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1)
    seen: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(steps + 1):
        if i == steps:
            for name, mod in model.named_modules():
                if isinstance(mod, nn.Linear) and name != "lm_head":
                    mod.register_forward_hook(
                        lambda m, a, out, name=name: seen.setdefault(name, {}).update(
                            x=a[0].detach().flatten(0, -2).float()
                        )
                    )
                    mod.register_full_backward_hook(
                        lambda m, gi, go, name=name: seen.setdefault(name, {}).update(
                            g=go[0].detach().flatten(0, -2).float()
                        )
                    )
        x, y = demo.get_batch(data, starts[i], size.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: (d["g"], d["x"]) for name, d in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--gpt-steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'input class':62s} {'plain':>7s} {'RHT':>7s} {'gain':>6s} | {'SR g: plain':>11s} {'RHT':>7s} {'gain':>6s}")

    def row(name, pairs):
        rows = []
        for i, (g, x) in enumerate(pairs):
            torch.manual_seed(i)
            rows.append(
                [
                    wgrad_sqnr(g, x, False),
                    wgrad_sqnr(g, x, True),
                    wgrad_sqnr(g, x, False, "stochastic"),
                    wgrad_sqnr(g, x, True, "stochastic"),
                ]
            )
        p, r, ps, rs = torch.tensor(rows).mean(0).tolist()
        print(f"{name:62s} {p:7.2f} {r:7.2f} {r - p:+6.2f} | {ps:11.2f} {rs:7.2f} {rs - ps:+6.2f}", flush=True)

    for name, make in classes().items():
        row(name, [make(torch.Generator().manual_seed(s)) for s in range(args.seeds)])
    for name, pair in gpt_operands(args.gpt_steps).items():
        row(f"demo GPT after {args.gpt_steps} steps: {name}", [pair])


if __name__ == "__main__":
    main()
