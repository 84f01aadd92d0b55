"""What FP8 and INT4 weights cost the two shipped models in accuracy: teacher-forced next-token agreement with the
unquantized model, and perplexity, over the same positions of real English text.

Text: Python's own language-reference topics (``pydoc_data.topics``, on every machine), its first 100,000
characters, tokenized by each model's tokenizer and cut into windows of ``--window`` + 1 tokens (Gemma's BOS
first, as its tokenizer adds it), each scored at its last ``--window`` positions. Each model runs once per weight
format over the same windows, on the CPU in float32 through ``DenseAttention`` (Gemma's sliding layers too):

- ``none``: the checkpoint's weights in float32 (the reference);
- ``bf16 weights``: every tensor rounded to bf16, a control: what a harmless rounding moves;
- ``fp8``: linears kept in the GPU's layout (e4m3 weights, a scale per row) and run by their reference GEMM, which
  also quantizes activations per token as the FP8 kernel does: the values the GPU computes;
- ``fp8 weights only``: the CPU's ``--quantization fp8`` (weights quantized and dequantized, activations not);
- ``int4``: W4A16 in the GPU's layout, groups of 128 inputs (``--quantization int4``), or of the widest group
  that divides every linear's inputs where 128 does not (SmolLM2's 576: the engine refuses int4 there);
  ``--int4-group`` picks another.

The shipped checkpoints are themselves 4-bit GGUFs (Q4_1, Q4_K_M), so the reference is those weights in float32
and FP8 / INT4 quantize them again. Agreement: the quantized model's argmax equals the reference's; the perplexity
is ``exp`` of the mean negative log-likelihood of the text's next token. The last column says whether a row meets
the issue's bar (#60): FP8 >= 99% agreement and perplexity within +1%, INT4 perplexity within +5%.

    python benchmarks/quant_accuracy.py                    # both models, 2 windows of 1,024 scored tokens
    python benchmarks/quant_accuracy.py --model gemma-3-270m --windows 4 --int4-group 32
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace

import pydoc_data.topics
import torch

from hybridkv.bench.tables import markdown_table
from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.planner import fitted_format
from hybridkv.kv.weight_formats import FP8, UNQUANTIZED, WeightFormat, checkpoint_format
from hybridkv.model.attention.dense import DenseAttention
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.factory import build_model
from hybridkv.model.loading.gguf_reader import read_gguf
from hybridkv.model.loading.known_models import DEFAULT_MODEL, resolve_model
from hybridkv.model.loading.tokenizer import Tokenizer
from hybridkv.model.loading.weights import load_weights
from hybridkv.model.quantization.weight_plan import WeightPlan

Tensors = dict[str, torch.Tensor]  # a checkpoint's, by HF name, in float32

MODELS = (DEFAULT_MODEL, "gemma-3-270m")
TEXT_CHARS = 100_000  # about 24,000 tokens with either tokenizer: 23 windows of 1,024
LOGIT_ROWS = 256  # rows through the LM head at a time: Gemma's 262,144-entry vocabulary is 1 GiB of logits per 1,024 rows
# the bars (#60)
FP8_MIN_AGREEMENT, FP8_MAX_PPL_RISE, INT4_MAX_PPL_RISE = 0.99, 0.01, 0.05


@dataclass(slots=True)
class Scores:
    """Per scored position: the model's argmax and the negative log-likelihood of the text's token."""

    argmax: torch.Tensor
    nll: torch.Tensor

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.double().mean().item())


def windows(tokenizer: Tokenizer, window: int, count: int) -> list[torch.Tensor]:
    """``count`` sequences of ``window`` + 1 tokens: the tokenizer's own prefix (Gemma's BOS, SmolLM2's none), then
    consecutive text. Every token but the first is predicted from those before it."""
    text = "\n\n".join(pydoc_data.topics.topics.values())[:TEXT_CHARS]
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefix = tokenizer.encode("")
    step = window + 1 - len(prefix)
    if len(ids) < count * step:
        raise ValueError(f"the text has {len(ids):,} tokens, fewer than {count} windows of {step}")
    return [torch.tensor(prefix + ids[i * step : (i + 1) * step]) for i in range(count)]


@torch.no_grad()
def score(model: CausalLM, hf_config: dict, seqs: list[torch.Tensor]) -> Scores:
    specs = layer_specs_from_hf_config(hf_config, kv_cache_dtype="float32")
    argmax, nll = [], []
    for seq in seqs:
        hidden = model(seq[:-1], torch.arange(len(seq) - 1), DenseAttention(specs, [len(seq) - 1]))
        for start in range(0, len(hidden), LOGIT_ROWS):
            logp = torch.log_softmax(model.compute_logits(hidden[start : start + LOGIT_ROWS]).float(), dim=-1)
            target = seq[start + 1 : start + 1 + len(logp)]
            argmax.append(logp.argmax(-1))
            nll.append(-logp.gather(1, target[:, None])[:, 0])
    return Scores(torch.cat(argmax), torch.cat(nll))


def int4_format(hf_config: dict, group: int | None = None) -> WeightFormat:
    """INT4 as ``--quantization int4`` takes it (``fitted_format``: groups of 128, or the widest of 64 and 32 that
    divides every linear's inputs: SmolLM2's q/k/v and gate/up read 576 = 9 x 64), or in groups of ``group``."""
    fmt = fitted_format(hf_config, "int4")
    return fmt if group is None else replace(fmt, group_size=group)


def variants(tensors: Tensors, own: WeightFormat, int4: WeightFormat) -> dict[str, tuple[WeightPlan, Tensors]]:
    """Label -> (how the linears are loaded, the checkpoint's tensors). ``keep``: the GPU's layout, here run by
    the reference GEMM. The bf16 control rounds every tensor to bf16 (a bf16 checkpoint, computed in float32)."""
    bf16 = {name: t.to(torch.bfloat16).float() for name, t in tensors.items()}
    return {
        "bf16 weights (control)": (WeightPlan(UNQUANTIZED, own, keep=False), bf16),
        "fp8 (W8A8)": (WeightPlan(FP8, own, keep=True), tensors),
        "fp8 weights only": (WeightPlan(FP8, own, keep=False), tensors),
        f"int4 g{int4.group_size} (W4A16)": (WeightPlan(int4, own, keep=True), tensors),
    }


def built(hf_config: dict, tensors: Tensors, plan: WeightPlan) -> CausalLM:
    """The model as ``load_checkpoint`` builds a GGUF's, with ``plan`` for its linears (the tensors read once)."""
    model = build_model(hf_config, torch.float32, weights=plan.kept)
    load_weights(model, tensors.items())
    plan.round_trip(model)
    return model


def measure(name: str, window: int, count: int, group: int | None = None) -> list[list[object]]:
    resolved = resolve_model(name)
    if resolved.kind != "gguf":
        raise ValueError(f"{name}: this benchmark reads GGUF checkpoints (a known name or a .gguf file)")
    ckpt = read_gguf(resolved.path, torch.float32)
    tensors = dict(ckpt.named_tensors(progress=False))  # dequantized once, loaded into every variant
    seqs = windows(Tokenizer.from_gguf(ckpt.reader), window, count)
    own = checkpoint_format(ckpt.hf_config)
    reference = built(ckpt.hf_config, tensors, WeightPlan(UNQUANTIZED, own, keep=False))
    ref = timed(f"{name} reference", reference, ckpt.hf_config, seqs)
    rows = [row(name, "none (reference)", ref, ref)]
    for label, (plan, weights) in variants(tensors, own, int4_format(ckpt.hf_config, group)).items():
        got = timed(f"{name} {label}", built(ckpt.hf_config, weights, plan), ckpt.hf_config, seqs)
        rows.append(row(name, label, got, ref, plan.served))
    return rows


def timed(label: str, model: CausalLM, hf_config: dict, seqs: list[torch.Tensor]) -> Scores:
    """``score``, its time on stderr (progress: the table is stdout's)."""
    start = time.perf_counter()
    got = score(model, hf_config, seqs)
    print(f"{label}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return got


def row(name: str, label: str, got: Scores, ref: Scores, served: WeightFormat = UNQUANTIZED) -> list[object]:
    agree = (got.argmax == ref.argmax).double().mean().item()
    ratio = got.perplexity / ref.perplexity
    return [name, label, f"{len(got.nll):,}", f"{agree:.2%}", f"{got.perplexity:.3f}", f"{ratio:.4f}",
            f"{ratio - 1:+.2%}", bar(served, agree, ratio - 1)]


def bar(served: WeightFormat, agree: float, rise: float) -> str:
    """Whether a row meets the issue's bar for its format (empty for the unquantized rows)."""
    if served.bits == 8:
        met = agree >= FP8_MIN_AGREEMENT and rise <= FP8_MAX_PPL_RISE
        return f"{'met' if met else 'missed'} (>= {FP8_MIN_AGREEMENT:.0%}, <= +{FP8_MAX_PPL_RISE:.0%})"
    if served.bits == 4:
        return f"{'met' if rise <= INT4_MAX_PPL_RISE else 'missed'} (<= +{INT4_MAX_PPL_RISE:.0%})"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append",
                        help=f"a known name or .gguf file (repeatable; default: {', '.join(MODELS)})")
    parser.add_argument("--window", type=int, default=1024, help="scored positions a window")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int4-group", type=int, help="INT4 inputs a scale (default: 128, or the widest that fits)")
    args = parser.parse_args()
    if min(args.window, args.windows, args.threads, args.int4_group or 1) < 1:
        parser.error("--window, --windows, --threads and --int4-group take positive numbers")
    torch.set_num_threads(args.threads)
    try:
        rows = [row for name in args.model or MODELS
                for row in measure(name, args.window, args.windows, args.int4_group)]
    except (ValueError, FileNotFoundError) as e:  # an unknown or uninstalled model, or too little text
        parser.error(str(e))
    head = ["model", "weights", "positions", "agreement", "ppl", "ppl ratio", "ppl +%", "bar (#60)"]
    print(markdown_table(head, rows))


if __name__ == "__main__":
    main()
