"""``hybridkv generate`` on the default model: the text on stdout, the speed on stderr (or in the JSON)."""

from __future__ import annotations

import json
import re

from hybridkv.cli import main
from hybridkv.commands.generate import speed_line

SMALL = ["--max-model-len", "64", "--kv-cache-memory-bytes", str(8 << 20), "--max-tokens", "3", "--no-chat"]


def test_generate_prints_tokens_per_second(capsys):
    assert main(["generate", "--prompt", "The capital of France is", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tokens/s" not in out
    assert re.search(r"^3 tokens in \d+\.\d\d s: \d+\.\d tokens/s \(first token after \d+\.\d\d s, with the "
                     r"\d+-token prompt; then \d+\.\d tokens/s\)$", err, re.M), err
    assert main(["generate", "--prompt", "The capital of France is", "--json", *SMALL]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 3
    assert abs(result["tokens_per_s"] - 3 / result["elapsed_s"]) < 0.05  # elapsed_s is rounded to 0.1 ms


def test_speed_line_counts_the_tokens_after_the_first_over_the_time_after_it():
    assert speed_line(1, 5, 0.25, 0.25) == "1 tokens in 0.25 s: 4.0 tokens/s (first token after 0.25 s, with the " \
                                           "5-token prompt)"
    assert speed_line(11, 5, 1.0, 3.0).endswith("then 5.0 tokens/s)")
