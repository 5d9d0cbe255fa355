"""The demo with --fp8-activations: the act. MiB column read from the storages the forward creates while the
context is active, and the issue's demo targets on the demo's own GPT (bytes, gradients)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import assert_sqnr, demo_table

from f8tensor import Float8LinearConfig, convert_to_float8_training, demo, save_activations_in_float8, sqnr


def _table(capsys, *flags: str) -> tuple[str, dict[str, dict[str, str]]]:
    argv = ["--size", "tiny", "--steps", "2", "--recipes", "bf16,tensorwise", "--seq-len", "32", *flags]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    return out, demo_table(out)


def test_the_flag_shrinks_the_fp8_rows_act_column_and_leaves_bf16_alone(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the PNG goes to ./out
    plain_out, plain = _table(capsys)
    fp8_out, fp8 = _table(capsys, "--fp8-activations")
    notes = " ".join(fp8_out.split())  # the notes are wrapped to 80 columns
    assert "FP8 runs save their activations in FP8" in notes and "--fp8-activations: FP8 runs" in notes
    assert "save_activations_in_float8" not in plain_out
    # The baseline row's MiB is the same either way; the FP8 row's ratio falls.
    assert plain["bf16"]["act. MiB"] == fp8["bf16"]["act. MiB"]
    plain_ratio = float(plain["tensorwise"]["act. MiB vs bf16"].rstrip("x"))
    fp8_ratio = float(fp8["tensorwise"]["act. MiB vs bf16"].rstrip("x"))
    # Tiny (width 64: only tensors of 65,536 elements with 128 columns qualify, here the
    # MLP's hidden activations and the logits): measured 0.90x -> 0.69x.
    assert fp8_ratio <= plain_ratio - 0.15, (plain_ratio, fp8_ratio)


def test_recompute_choice_shrinks_act_further_and_the_peak_column_is_shown(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, fp8 = _table(capsys, "--fp8-activations")
    out, rebuilt = _table(capsys, "--fp8-activations", "recompute")
    assert "save_activations_in_float8(recompute=True)" in out
    fp8_ratio = float(fp8["tensorwise"]["act. MiB vs bf16"].rstrip("x"))
    rebuilt_ratio = float(rebuilt["tensorwise"]["act. MiB vs bf16"].rstrip("x"))
    # Measured (tiny): 0.69x -> 0.68x (its LayerNorm outputs are below min_numel, GELU's
    # backward saves only its input, which the context packs anyway).
    assert rebuilt_ratio < fp8_ratio, (fp8_ratio, rebuilt_ratio)
    for row in rebuilt.values():
        assert float(row["peak MiB"]) > float(row["act. MiB"]), row
    assert max(len(line) for line in out.split("\n\n")[1].splitlines()) <= 80


def test_a_bad_fp8_activations_choice_is_refused(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--fp8-activations", "bf16"])
    err = capsys.readouterr().err
    assert "--fp8-activations: invalid choice: 'bf16'" in err and "recompute" in err


def test_the_flag_is_in_the_help():
    assert "--fp8-activations" in demo.build_parser().format_help()


def _small_gpt():
    size = demo.SIZES["small"]
    torch.manual_seed(0)
    model = demo.GPT(size)
    data = demo.load_corpus(torch.device("cpu"))
    starts = demo.batch_starts(len(data), 1, size.batch_size, size.seq_len, 0)
    x, y = demo.get_batch(data, starts[0], size.seq_len)
    return model, x, y


def _fp8(model, recipe="tensorwise"):
    return convert_to_float8_training(
        copy.deepcopy(model),
        config=Float8LinearConfig.from_recipe(recipe),
        module_filter_fn=demo.keep_lm_head_in_high_precision,
    )


def test_act_column_of_the_demo_gpt_with_fp8_linears_and_the_context():
    model, x, y = _small_gpt()
    fp8 = _fp8(model)
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    for m in (model, fp8):  # one step first: what a first call allocates and keeps is not an activation
        with amp:
            logits = m(x)
        demo._loss(logits, y).backward()
    bf16 = demo.saved_activation_bytes(model, x, y, amp)
    fp8_only = demo.saved_activation_bytes(fp8, x, y, amp)
    both = demo.saved_activation_bytes(fp8, x, y, amp, save_activations_in_float8)
    # Measured (the small demo GPT, 1,024 tokens): bf16 11,354,628 bytes; tensorwise
    # 0.885x; tensorwise with the context 0.544x (the target: <= 0.55x). What stays
    # in bf16: attention's q, k, v and output (head width 32 < block 128), LayerNorm's
    # per-row statistics, the weights' autocast copies (excluded here, as parameters are).
    assert fp8_only <= 0.90 * bf16, fp8_only / bf16
    assert both <= 0.55 * bf16, both / bf16


def _grads(model, x, y, context):
    model.zero_grad(set_to_none=True)
    with context():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = demo._loss(logits, y)
    loss.backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_gradient_sqnr_of_the_demo_gpt_against_the_step_without_the_context(recipe):
    model, x, y = _small_gpt()
    if recipe != "bf16":
        model = _fp8(model, recipe)
    ref = _grads(model, x, y, contextlib.nullcontext)
    got = _grads(model, x, y, save_activations_in_float8)
    total = sqnr(torch.cat([g.flatten() for g in ref.values()]), torch.cat([g.flatten() for g in got.values()]))
    # Measured: bf16 43.9 dB, tensorwise 36.3 dB over all parameters (the target:
    # >= 28 dB); per parameter at worst 38.5 dB (bf16) and 27.5 dB (tensorwise,
    # blocks.0.ln2.weight; target >= 18 dB).
    assert total >= 28.0 and total >= {"bf16": 40.0, "tensorwise": 33.0}[recipe], total
    for name in ref:
        assert_sqnr(ref[name], got[name], {"bf16": 35.0, "tensorwise": 24.0}[recipe], name)
