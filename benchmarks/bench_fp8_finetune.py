"""Fine-tuning an FP8 checkpoint: memory of the frozen FP8 base, and LoRA's loss on it.

A small Llama-architecture model (bytes as tokens, vocab 256) is trained from scratch on the
demo's corpus (``f8tensor/data/corpus.txt``) with the blockwise recipe and exported with
``save_fp8_pretrained(format="fp8_block")``. Then:

- *bytes per weight element* of the quantized linears, and bytes per parameter of the whole
  model: loaded with ``load_fp8_pretrained`` (frozen FP8: data, scale and the file's multiplier)
  against ``AutoModelForCausalLM.from_pretrained`` (transformers' dequantizing path on a CPU: bf16);
- *LoRA*: r=8 on every linear, AdamW, the same batches, on the frozen FP8 base (FP8 GEMMs, the
  file's bytes) against the dequantized bf16 base (bf16 GEMMs); the mean of the last 20 losses.

    python benchmarks/bench_fp8_finetune.py            # CPU, a few minutes
    python benchmarks/bench_fp8_finetune.py --quick    # smoke size
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings

import torch

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.demo.gpt import batch_starts, get_batch, load_corpus
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        head_dim=64,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )


def _train(model, data, starts, args, lr):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for row in starts:
        x, _ = get_batch(data, row, args.seq_len)
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LINEARS))


def _linear_bytes(model) -> tuple[int, int]:
    """(persistent bytes, elements) of the quantized linears' weights."""
    held = elements = 0
    for mod in model.modules():
        if isinstance(mod, FrozenFloat8Linear):
            w = mod.weight
            held += sum(t.numel() * t.element_size() for t in (w._data, w._scale, mod.checkpoint_scale))
            elements += w.numel()
        elif type(mod).__name__ == "Linear" and any(
            mod is getattr(p, n, None) for p in model.modules() for n in LINEARS
        ):
            held += mod.weight.numel() * mod.weight.element_size()
            elements += mod.weight.numel()
    return held, elements


def _model_bytes(model) -> tuple[int, int]:
    """(persistent bytes, parameters) of the whole model, FP8 weights counted as they are held."""
    held = count = 0
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(mod, FrozenFloat8Linear) and name == "weight":
                held += sum(t.numel() * t.element_size() for t in (p._data, p._scale, mod.checkpoint_scale))
            else:
                held += p.numel() * p.element_size()
            count += p.numel()
    return held, count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--lora-steps", type=int, default=100)
    parser.add_argument("--last", type=int, default=20, help="losses averaged at the end")
    parser.add_argument("--quick", action="store_true", help="smoke size")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.seq_len, args.pretrain_steps, args.lora_steps, args.last = 128, 1, 64, 10, 10, 5
    warnings.filterwarnings("ignore", message=".*no cpu kernel.*")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    data = load_corpus(torch.device("cpu"))
    starts = batch_starts(len(data), args.pretrain_steps + args.lora_steps + 1, args.batch, args.seq_len, seed=0)
    model = AutoModelForCausalLM.from_config(_config(args), dtype=torch.bfloat16)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    pre = _train(model, data, starts[: args.pretrain_steps], args, lr=3e-3)
    with tempfile.TemporaryDirectory(prefix="fp8-finetune-") as directory:
        save_fp8_pretrained(model, directory, format="fp8_block")
        with torch.device("meta"):
            fp8 = AutoModelForCausalLM.from_config(_config(args), dtype=torch.bfloat16)
        load_fp8_pretrained(fp8, directory)
        bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    lin_fp8, lin_bf16 = _linear_bytes(fp8), _linear_bytes(bf16)
    all_fp8, all_bf16 = _model_bytes(fp8), _model_bytes(bf16)

    lora_steps = starts[args.pretrain_steps : args.pretrain_steps + args.lora_steps]
    torch.manual_seed(1)
    loss_fp8 = _train(_lora(fp8), data, lora_steps, args, lr=1e-3)
    torch.manual_seed(1)
    loss_bf16 = _train(_lora(bf16), data, lora_steps, args, lr=1e-3)
    mean_fp8 = sum(loss_fp8[-args.last :]) / args.last
    mean_bf16 = sum(loss_bf16[-args.last :]) / args.last

    print(
        f"torch {torch.__version__}, CPU; Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq_len}, batch {args.batch}"
    )
    print(f"pretrain: {args.pretrain_steps} blockwise FP8 steps, loss {pre[0]:.3f} -> {pre[-1]:.3f}; export fp8_block")
    print("| base | linear weights, bytes/element | model, bytes/parameter |")
    print("| --- | ---: | ---: |")
    print(f"| load_fp8_pretrained (frozen FP8) | {lin_fp8[0] / lin_fp8[1]:.4f} | {all_fp8[0] / all_fp8[1]:.4f} |")
    print(f"| from_pretrained (dequantized bf16) | {lin_bf16[0] / lin_bf16[1]:.4f} | {all_bf16[0] / all_bf16[1]:.4f} |")
    rel = (mean_fp8 - mean_bf16) / mean_bf16
    print(f"LoRA r=8, {args.lora_steps} steps, mean of the last {args.last} losses:")
    print(f"| frozen FP8 base | {mean_fp8:.4f} | first {loss_fp8[0]:.4f} |")
    print(f"| dequantized bf16 base | {mean_bf16:.4f} | first {loss_bf16[0]:.4f} |")
    print(f"| difference | {100 * rel:+.3f}% | |")
    return 0 if abs(rel) <= 0.01 or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
