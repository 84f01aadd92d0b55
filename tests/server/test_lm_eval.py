"""lm-eval's ``local-completions`` against a ``hybridkv serve`` subprocess of a tiny random checkpoint: a local
multiple-choice task's per-choice loglikelihoods equal transformers' on the same checkpoint, and a generate_until
task gets transformers' greedy text cut at its stop strings.

lm-eval finds the server's ``/tokenizer_info`` and ``/tokenize`` and tokenizes through them (its remote tokenizer);
with ``--batch_size N`` it sends N prompts per request. The checkpoint's tokenizer is the word tokenizer of
``tiny_models.py``: token i is the word ``w<i>``, EOS is w1.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_lifecycle import ServerProcess

lm_eval = pytest.importorskip("lm_eval")

MODEL = "tiny"
EOS = 1
MC_DOCS = [  # contexts and choices of a few words each; choices differ in length
    {"context": "w5 w17 w33 w8", "choices": ["w40 w41", "w12", "w90 w3 w77"], "label": 0},
    {"context": "w60 w6", "choices": ["w6 w6", "w19 w55"], "label": 1},
    {"context": "w11 w22 w33 w44 w55 w66 w77 w88 w20 w30 w45", "choices": ["w3", "w4", "w70 w71"], "label": 2},
]
GEN_DOCS = [{"context": "w5 w17 w33 w8", "target": "x"}, {"context": "w60 w6 w61 w62 w63", "target": "x"}]
MAX_GEN_TOKS = 6
UNTIL = ["w26"]


def mc_docs(model) -> list[dict]:
    """``MC_DOCS`` and one whose first choice is the model's greedy continuation (lm-eval's ``is_greedy``)."""
    context = "w13 w31 w50"
    greedy = " ".join(f"w{t}" for t in model.greedy(ids(context), 2))
    return [*MC_DOCS, {"context": context, "choices": [greedy, "w2 w2"], "label": 0}]


def dataset_kwargs(tmp_path, name: str) -> str:
    """The local data file, and a cache inside the test's folder (not the user's ~/.cache)."""
    return (f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / f'{name}.jsonl'}\n"
            f"  cache_dir: {tmp_path / 'datasets'}\n")


def write_tasks(tmp_path, model) -> None:
    for name, docs in (("mc", mc_docs(model)), ("gen", GEN_DOCS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: context\n"
    (tmp_path / "mc.yaml").write_text(
        f"task: hybridkv_mc\n{common}{dataset_kwargs(tmp_path, 'mc')}"
        "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        f"task: hybridkv_gen\n{common}{dataset_kwargs(tmp_path, 'gen')}"
        "output_type: generate_until\ndoc_to_target: target\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: bypass\n")


def ids(words: str) -> list[int]:
    return [int(w[1:]) for w in words.split()]


def loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' sum of the continuation's log-softmax, and whether each of its tokens is the argmax."""
    ctx, cont = ids(context), ids(continuation)
    with torch.no_grad():
        logprobs = torch.log_softmax(model.hf(torch.tensor([ctx + cont])).logits[0].float(), -1)
    rows = logprobs[len(ctx) - 1 : -1]
    picked = rows[torch.arange(len(cont)), torch.tensor(cont)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(cont)).all())


def greedy_text(model, context: str) -> str:
    """The server's text for transformers' greedy tokens: EOS ends it unshown, a stop string cuts it."""
    text = ""
    for token in model.greedy(ids(context), MAX_GEN_TOKS):
        if token == EOS:
            break
        text += f" w{token}"  # the word tokenizer decodes a token after others as a space and its word
        cuts = [text.find(s) for s in [*UNTIL, f"w{EOS}"] if s in text]
        if cuts:
            return text[: min(cuts)]
    return text


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama3")


@pytest.fixture(scope="module")
def server(model):
    # steps of 4 tokens: every context is prefilled in chunks; the prefix cache is on (a request asking for
    # prompt logprobs must still score the prefix it shares with the choices before it)
    args = ("--served-model-name", MODEL, "--max-num-batched-tokens", "4", "--block-size", "4",
            "--kv-cache-memory-bytes", str(8 << 20), "--max-num-seqs", "4")
    with ServerProcess(str(model.path), *args) as srv:
        yield srv


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_matches_transformers(server, model, tmp_path, monkeypatch, batch_size):
    """``batch_size`` 4: lm-eval sends up to 4 prompts (token-id lists) per request and reads the choices back by
    their ``index``."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the json loader needs nothing from the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path, model)
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server.url}/v1/completions", "model": MODEL, "num_concurrent": 1,
                    "max_retries": 1},
        tasks=["hybridkv_mc", "hybridkv_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
        batch_size=batch_size,
    )
    samples = results["samples"]["hybridkv_mc"]
    assert len(samples) == len(MC_DOCS) + 1
    greedy_seen = False
    for sample in samples:
        doc = sample["doc"]
        got = [resp[0] for resp in sample["resps"]]
        assert len(got) == len(doc["choices"])
        for (ll, greedy), choice in zip(got, doc["choices"]):
            want_ll, want_greedy = loglikelihood(model, doc["context"], choice)
            assert ll == pytest.approx(want_ll, abs=1e-3), (doc, choice)
            assert greedy == want_greedy
            greedy_seen |= greedy
    assert greedy_seen
    gen = results["samples"]["hybridkv_gen"]
    assert [s["resps"][0][0] for s in gen] == [greedy_text(model, d["context"]) for d in GEN_DOCS]
