"""``hybridkv plan``: the table, --json, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli import build_parser, main

REPO = Path(__file__).parents[1]
SCOUT = REPO / "tests" / "data" / "scout-text-config.json"
GIB = 1 << 30
SCOUT_ARGS = ["plan", "--model", str(SCOUT), "--tensor-parallel-size", "8", "--kv-memory-gib", "89.71"]


def run(capsys, *extra: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main([*SCOUT_ARGS, *extra]))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_table(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert "chunked(8192)" in out and "full" in out
    row = next(line for line in out.splitlines() if line.startswith("max_model_len "))
    hybrid, flat = row.split()[1:]
    assert int(hybrid.replace(",", "")) > 15_600_000
    assert int(flat.replace(",", "")) == pytest.approx(3_919_664, rel=1e-3)
    assert "concurrency @ 1M" in out and "concurrency @ 128K" in out


def test_model_dir_and_no_hybrid(capsys, tmp_path):
    (tmp_path / "config.json").write_text(SCOUT.read_text())
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["plan", "--model", str(tmp_path), "--tensor-parallel-size", "8", "--kv-memory-gib", "89.71",
                       "--no-hybrid", "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert exit_info.value.code == 0
    assert out["hybrid"] is False and out["comparison"]["hybrid"] is True
    assert out["max_model_len"] < out["comparison"]["max_model_len"]


def test_json(capsys):
    code, out, _ = run(capsys, "--json", "--kv-cache-dtype", "fp8_e4m3", "--max-model-len", "40000000")
    plan = json.loads(out)
    assert code == 0
    assert plan["kv_cache_dtype"] == "fp8_e4m3"
    assert plan["fits"] is False and plan["max_model_len"] > 31_000_000 and plan["reason"]


def test_gpu_memory_estimate(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["plan", "--model", str(SCOUT), "--tensor-parallel-size", "8", "--gpu-memory-gib", "139",
                       "--gpu-memory-utilization", "0.9"]))
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "(estimate)" in out and "weights" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2"),
        (["--block-size", "24"], "power of two"),
        (["--tensor-parallel-size", "3"], "tensor_parallel_size 3"),
        (["--max-model-len", "0"], "max_model_len"),
        (["--gpu-memory-gib", "80"], "not allowed with"),
        (["--block-size", "x"], "invalid int value"),
        (["--quantization", "gptq"], "invalid choice: 'gptq'"),
        (["--quantization", "awq"], "quantization awq needs a checkpoint in that format"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, args, needle):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_missing_memory_and_missing_file(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["plan", "--model", str(SCOUT)]))
    assert exit_info.value.code == 2 and "--kv-memory-gib" in capsys.readouterr().err
    assert main(["plan", "--model", "/no/such/model", "--kv-memory-gib", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/no/such/model" in err


def test_subprocess_bad_json_no_traceback(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "plan", "--model", str(bad), "--kv-memory-gib", "1"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "not valid JSON" in proc.stderr


def test_every_subcommand_is_wired(capsys):
    parser = build_parser()
    for command in ("serve", "generate", "plan", "bench"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([command, "--help"])
        assert exit_info.value.code == 0
        assert command in capsys.readouterr().out


def test_gpu_memory_reserve_is_the_engines_for_the_same_flags(capsys):
    """--max-num-seqs and an FP8 cache size the step reserve exactly as ``serve`` with the same flags on a GPU."""
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.kv_sizing import step_reserve_bytes

    gpu = ["plan", "--model", str(SCOUT), "--tensor-parallel-size", "8", "--gpu-memory-gib", "139", "--json"]
    for extra, config in [
        ([], EngineConfig()),
        (["--max-num-seqs", "32", "--kv-cache-dtype", "fp8_e4m3"], EngineConfig(max_num_seqs=32,
                                                                                 kv_cache_dtype="fp8_e4m3")),
    ]:
        assert main([*gpu, *extra]) == 0
        memory = json.loads(capsys.readouterr().out)["memory"]
        assert memory["activation_reserve_bytes"] == step_reserve_bytes(config, 5120, 202_048)


def test_weights_that_do_not_fit_are_named_with_the_smallest_tp_that_fits(capsys):
    """Scout's bf16 weights (~200.7 GiB) on one 139.8 GiB GPU: no traceback, but a plan that says the weights alone
    do not fit and names the smallest tensor-parallel size that does (2: ~100 GiB per rank)."""
    one_gpu = ["plan", "--model", str(SCOUT), "--gpu-memory-gib", "139.8"]
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", *one_gpu], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    reason = next(line for line in proc.stdout.splitlines() if line.startswith("does not fit: "))
    assert "the weights alone (200.7" in reason and "tensor-parallel size 1, bfloat16) exceed the 125.82 GiB" in reason
    assert "; the smallest tensor-parallel size that fits is 2 (bfloat16); " in reason
    assert reason.endswith("; with --quantization fp8 it fits at tensor-parallel size 1"
                           "; with --quantization int4 it fits at tensor-parallel size 1")

    assert main([*one_gpu, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["kv_memory_bytes"] == 0 and plan["memory"]["weights_bytes"] > 200 * GIB
    for reason in (plan["reason"], plan["comparison"]["reason"]):
        assert "is 2 (bfloat16); with --quantization fp8 it fits at tensor-parallel size 1" in reason
    assert main([*one_gpu, "--tensor-parallel-size", "2", "--json"]) == 0  # and 2 does fit
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["reason"] == "" and plan["max_model_len"] > 0


def test_gpu_memory_reserve_keeps_the_collectives_scratch_at_two_ranks(capsys):
    """At TP 2 the prefill halves' copy-engine slots (``CopyEngineSums.scratch_bytes``: 4 x 1 x 4,096 rows x 5,120
    bf16 values = 160 MiB at 8,192-token steps) are in the plan's reserve, as in the engine's."""
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.kv_sizing import step_reserve_bytes

    reserves = []
    for size in ("2", "8"):
        assert main(["plan", "--model", str(SCOUT), "--tensor-parallel-size", size, "--gpu-memory-gib", "139",
                     "--json"]) == 0
        reserves.append(json.loads(capsys.readouterr().out)["memory"]["activation_reserve_bytes"])
    assert reserves[0] == step_reserve_bytes(EngineConfig(tensor_parallel_size=2), 5120, 202_048)
    assert reserves[0] - reserves[1] == 160 << 20


def test_quantization_flag_counts_the_weights_in_that_format(capsys):
    """Scout on one 139.8 GiB GPU with --quantization int4 and an FP8 cache: 54.62 GiB of weights (int4 group 128
    for the linear layers, bf16 embeddings and LM head), and a KV pool of over 2.5M tokens; at TP 2 over 8M."""
    one_gpu = ["plan", "--model", str(SCOUT), "--gpu-memory-gib", "139.8", "--kv-cache-dtype", "fp8_e4m3",
               "--quantization", "int4"]
    assert main(one_gpu) == 0
    out = capsys.readouterr().out
    assert "weights: int4 (group 128, W4A16, quantized at load) 54.62 GiB per rank" in out
    assert "does not fit" not in out
    lengths = []
    for size in ("1", "2"):
        assert main([*one_gpu, "--tensor-parallel-size", size, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["memory"]["weights_format"] == "int4" and plan["fits"]
        lengths.append(plan["max_model_len"])
    assert lengths[0] > 2_500_000 and lengths[1] > 8_000_000
    assert main([*one_gpu[:-1], "none", "--json"]) == 0  # none: every weight bf16, which one GPU cannot hold
    assert json.loads(capsys.readouterr().out)["memory"]["weights_format"] == "bfloat16"


def test_fp8_counts_the_routed_experts_in_fp8(capsys):
    """Scout with --quantization fp8: every linear, the routed experts included, at 1 byte a weight and a float32
    scale per output row: 102.37 GiB at TP 1, so one 139.8 GiB GPU holds over 700,000 tokens of FP8 cache."""
    one_gpu = ["plan", "--model", str(SCOUT), "--gpu-memory-gib", "139.8", "--kv-cache-dtype", "fp8_e4m3",
               "--quantization", "fp8"]
    assert main(one_gpu) == 0
    assert "dynamic activation scales, quantized at load) 102.37 GiB per rank" in capsys.readouterr().out
    assert main([*one_gpu, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["max_model_len"] == 720_864


def test_quantization_flag_has_serves_name():
    """``--quantization`` is the flag ``serve`` builds from ``EngineConfig.quantization``, with its default."""
    from hybridkv.engine.config import EngineConfig

    parser = build_parser()
    plan = parser.parse_args(["plan", "--model", "m", "--kv-memory-gib", "1"])
    serve = parser.parse_args(["serve", "m"])
    assert plan.quantization == serve.quantization == EngineConfig().quantization == "auto"
