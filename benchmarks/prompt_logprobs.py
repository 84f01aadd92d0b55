"""What prompt logprobs add to a prefill: one prompt prefilled and one token sampled, without and with
``prompt_logprobs`` (every prompt position through the LM head, log-softmax, rank and top k).

    python benchmarks/prompt_logprobs.py                       # SmolLM2-135M, 1,024 tokens, k = 5
    python benchmarks/prompt_logprobs.py --prompt-len 4096 --device cuda

Each time is the median over rounds of this process's CPU time on a CPU (other load on a shared machine does not
inflate it) and of wall time on a GPU; the prefix cache is off, so every round prefills the whole prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridkv import LLM, SamplingParams


def median_seconds(llm: LLM, prompt: list[int], params: SamplingParams, rounds: int) -> float:
    on_gpu = llm.engine.config.device.startswith("cuda")
    clock = time.perf_counter if on_gpu else time.process_time
    times = []
    for _ in range(rounds):
        start = clock()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        if on_gpu:
            torch.cuda.synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    llm = LLM(model=args.model, device=args.device, max_model_len=args.prompt_len + 16,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    vocab = llm.engine.model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = median_seconds(llm, prompt, SamplingParams(max_tokens=1), args.rounds)
    scored = median_seconds(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=args.top_k), args.rounds)
    print(f"{args.prompt_len:,}-token prefill on {llm.engine.config.device}: {plain:.3f} s plain, {scored:.3f} s "
          f"with prompt_logprobs={args.top_k} (+{scored / plain - 1:.0%})")


if __name__ == "__main__":
    main()
