import pytest

from hybridkv.engine.output_processing import (
    IncrementalDetokenizer,
    OutputTokenIds,
    RequestOutputState,
    check_stop,
    find_stop_string,
)
from hybridkv.engine.sampling_params import SamplingParams

EOS = 0


class FakeSentencePiece:
    """Byte pieces, '▁' for spaces, leading space stripped like sentencepiece."""

    def __init__(self):
        pieces = ["</s>", "▁Hello", "▁world", "!", "▁St", "OP", "▁end", "\n", "▁a", "b"]
        self.vocab = {i: p.encode() for i, p in enumerate(pieces)}
        self.special = {EOS}
        self.byte_base = len(self.vocab)
        for b in range(256):  # byte fallback tokens
            self.vocab[self.byte_base + b] = bytes([b])

    def ids(self, *items):
        """Piece ids, or byte-fallback ids for raw strings wrapped in a tuple."""
        out = []
        for it in items:
            if isinstance(it, tuple):
                out += [self.byte_base + b for b in it[0].encode()]
            else:
                out.append(next(i for i, p in self.vocab.items() if p == it.encode()))
        return out

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(
            self.vocab[i] for i in ids if not (skip_special_tokens and i in self.special))
        text = data.decode("utf-8", errors="replace").replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


@pytest.fixture
def tok():
    return FakeSentencePiece()


def feed(state, ids, **kw):
    deltas = []
    for t in ids:
        state.append_token(t, **kw)
        deltas.append(state.take_delta())
        if state.finished:
            break
    return deltas


# ---------------------------------------------------------------- detokenizer


def test_leading_space_kept_with_prompt_context(tok):
    d = IncrementalDetokenizer(tok, tok.ids("▁Hello"))
    assert [d.add_token(t) for t in tok.ids("▁world", "!")] == [" world", "!"]
    # Without context the sequence start is stripped, exactly as a full decode.
    d = IncrementalDetokenizer(tok, [])
    assert [d.add_token(t) for t in tok.ids("▁Hello", "▁world")] == ["Hello", " world"]


def test_a_long_prompt_is_not_copied_and_its_tail_gives_the_context(tok):
    prompt = tok.ids(*["▁Hello", "▁world", "!"] * 40)
    out = tok.ids("▁end", ("é",), "▁a", "b")
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add_token(t) for t in out]
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)):] == " endé ab"
    assert len(d._ids) == 5 + len(out)  # the prompt's last 5 tokens, not all 120


def test_multibyte_characters_held_back_until_complete(tok):
    ids = tok.ids("▁Hello", ("é🙂中",), "!")
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.add_token(t) for t in ids]
    assert "".join(deltas) == "Helloé🙂中!" == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas)
    # "é" is 2 bytes: first byte yields nothing, the second the whole char.
    assert deltas[1:3] == ["", "é"]
    assert deltas[3:7] == ["", "", "", "🙂"]


def test_real_bytelevel_bpe_tokenizer_roundtrip():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["hello world, the quick brown fox"] * 50, trainer)
    text = "hello wörld 🙂 — 你好 fox"
    ids = t.encode(text).ids
    d = IncrementalDetokenizer(t, [])
    deltas = [d.add_token(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


# ---------------------------------------------------------------- stop conditions


def test_eos_stops_and_is_not_in_text(tok):
    st = RequestOutputState.create(SamplingParams(), tok.ids("▁Hello"), tok)
    deltas = feed(st, tok.ids("▁world") + [EOS, 5], eos_token_ids=[EOS])
    assert st.finish_reason == "stop" and st.stop_reason is None
    assert st.token_ids == tok.ids("▁world") + [EOS]
    assert st.text == " world" and "".join(deltas) == " world"


def test_ignore_eos_continues_until_length(tok):
    st = RequestOutputState.create(SamplingParams(ignore_eos=True, max_tokens=3), [], tok)
    feed(st, [EOS, EOS, EOS, EOS], eos_token_ids=[EOS])
    assert st.finish_reason == "length" and len(st.token_ids) == 3


def test_stop_token_ids(tok):
    nl = tok.ids("\n")[0]
    st = RequestOutputState.create(SamplingParams(stop_token_ids=[nl]), [], tok)
    feed(st, tok.ids("▁Hello", "\n", "!"))
    assert (st.finish_reason, st.stop_reason, st.text) == ("stop", nl, "Hello")
    p = SamplingParams(stop_token_ids=[nl], include_stop_str_in_output=True)
    st = RequestOutputState.create(p, [], tok)
    feed(st, tok.ids("▁Hello", "\n", "!"))
    assert (st.finish_reason, st.text) == ("stop", "Hello\n")


def test_stop_string_spanning_tokens_truncates(tok):
    st = RequestOutputState.create(SamplingParams(stop=["StOP"]), tok.ids("▁Hello"), tok)
    deltas = feed(st, tok.ids("▁world", "▁St", "OP", "▁end"))
    assert st.finish_reason == "stop" and st.stop_reason == "StOP"
    assert st.text == " world "
    assert st.token_ids == tok.ids("▁world", "▁St", "OP")
    # Streaming never emitted any part of the stop string.
    assert "".join(deltas) == " world "
    # The last len("StOP") - 1 chars are held back while they could be a prefix.
    assert deltas == [" wo", "rld", " "]


def test_include_stop_str_in_output(tok):
    p = SamplingParams(stop="StO", include_stop_str_in_output=True)
    st = RequestOutputState.create(p, [], tok)
    deltas = feed(st, tok.ids("▁Hello", "▁St", "OP", "▁end"))
    # Cut right after the stop string even though its token carried more.
    assert (st.finish_reason, st.text, "".join(deltas)) == ("stop", "Hello StO", "Hello StO")


def test_earliest_stop_string_wins():
    assert find_stop_string("xx abc", 4, ["bc", "a"], False) == ("a", 3)
    assert find_stop_string("xx abc", 4, ["bc", "a"], True) == ("a", 4)
    assert find_stop_string("ab", 0, ["a"], False) is None
    # A match wholly inside old text is not re-reported.
    assert find_stop_string("ab cd", 2, ["ab"], False) is None


def test_min_tokens_suppresses_stops(tok):
    p = SamplingParams(min_tokens=4, stop=["!"], stop_token_ids=[7])
    st = RequestOutputState.create(p, [], tok)
    feed(st, [EOS] + tok.ids("!", "\n", "▁world"), eos_token_ids=[EOS])
    assert st.finish_reason is None
    assert st.text == "!\n world"
    feed(st, tok.ids("!"))
    assert (st.finish_reason, st.stop_reason, st.text) == ("stop", "!", "!\n world")


def test_max_tokens_and_context_limit(tok):
    st = RequestOutputState.create(SamplingParams(max_tokens=2), [], tok)
    feed(st, tok.ids("▁a", "b", "b"))
    assert (st.finish_reason, st.text, len(st.token_ids)) == ("length", "ab", 2)

    st = RequestOutputState.create(SamplingParams(max_tokens=None), tok.ids("▁a") * 5, tok)
    feed(st, tok.ids("b") * 10, max_model_len=8)
    assert st.finish_reason == "length" and len(st.token_ids) == 3
    with pytest.raises(RuntimeError):
        st.append_token(1)


def test_stop_beats_length_on_same_token(tok):
    st = RequestOutputState.create(SamplingParams(max_tokens=2), [], tok)
    feed(st, tok.ids("▁a") + [EOS], eos_token_ids=[EOS])
    assert st.finish_reason == "stop"


def test_check_stop_direct(tok):
    st = RequestOutputState.create(SamplingParams(stop="ld"), [], tok)
    st.token_ids.append(2)
    st.text = "world"
    assert check_stop(st, new_char_count=5) == "stop"
    assert st.text == "wor" and st.stop_reason == "ld"


def test_logprobs_recorded(tok):
    st = RequestOutputState.create(SamplingParams(logprobs=1), [], tok)
    st.append_token(1, [(1, -0.1), (1, -0.1)])
    assert st.logprobs == [[(1, -0.1), (1, -0.1)]]
    st.append_token(2, [(2, -0.7), (1, -0.2)])
    st.append_token(3, None)  # a row without logprobs adds nothing
    assert st.cumulative_logprob == -0.1 + -0.7  # the sampled tokens' logprobs, in order
    st = RequestOutputState.create(SamplingParams(), [], tok)
    st.append_token(1, [(1, -0.1)])
    assert st.logprobs is None


def test_skip_special_tokens_false_keeps_eos_text(tok):
    p = SamplingParams(skip_special_tokens=False, ignore_eos=True)
    st = RequestOutputState.create(p, [], tok)
    feed(st, tok.ids("▁a") + [EOS], eos_token_ids=[EOS])
    assert st.text == "a</s>"


# ---------------------------------------------------------------- deferred text


def final_only(**kw):
    from hybridkv.engine.sampling_params import RequestOutputKind

    return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **kw)


@pytest.mark.parametrize("kw", [
    dict(),  # EOS stops, its text left out
    dict(skip_special_tokens=False),  # EOS stops, its text left out though special tokens are not skipped
    dict(skip_special_tokens=False, ignore_eos=True, max_tokens=12),  # EOS text kept
    dict(stop_token_ids=[7], include_stop_str_in_output=True),  # the stop token's text kept
    dict(stop_token_ids=[7]),
    dict(max_tokens=5),
])
def test_deferred_text_is_the_text_detokenized_token_by_token(tok, kw):
    prompt = tok.ids("▁Hello", "▁world")
    out = tok.ids("!", ("é🙂",), "▁a", "\n", "b", "▁end") + [EOS] + tok.ids("▁world")
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(list(ids))
            return tok.decode(ids, skip_special_tokens)

    now = RequestOutputState.create(SamplingParams(**kw), prompt, tok)
    later = RequestOutputState.create(final_only(**kw), prompt, Counting())
    assert not now.defer_text and later.defer_text
    feed(now, out, eos_token_ids=[EOS])
    feed_ids = out[: len(now.token_ids)]
    for i, t in enumerate(feed_ids):
        later.append_token(t, eos_token_ids=[EOS])
        assert not decoded  # nothing detokenized while the token ids decide everything
        if i == 3:
            later.catch_up_text()  # as the engine does while a GPU computes the next step
            assert later.text == now.text[: len(later.text)] and not later.pending
            decoded.clear()
    assert (later.finish_reason, later.stop_reason, later.token_ids) == (now.finish_reason, now.stop_reason,
                                                                         now.token_ids)
    assert later.text == now.text and later.take_delta() == now.text and later.take_delta() == ""
    assert now.finish_reason is not None


def test_stop_strings_and_streams_are_detokenized_at_once(tok):
    from hybridkv.engine.sampling_params import RequestOutputKind

    assert not RequestOutputState.create(final_only(stop=["x"]), [], tok).defer_text
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        assert not RequestOutputState.create(SamplingParams(output_kind=kind), [], tok).defer_text
    assert not RequestOutputState.create(final_only(), [], None).defer_text  # no tokenizer: no text at all


def test_output_ids_are_read_in_place_from_the_sequences_ids(tok):
    """One list per sequence: the state appends each token to the prompt-and-output ids it was given
    (``Sequence.all_token_ids``) and reads its outputs there."""
    ids = [5, 6, 7, 8]
    out = OutputTokenIds(ids, 2)
    assert (len(out), out[-1], out[0], list(out), out[1:]) == (2, 8, 7, [7, 8], [8])
    out.append(9)
    assert ids == [5, 6, 7, 8, 9] and out == [7, 8, 9]
    with pytest.raises(IndexError):
        out[3]
    sequence_ids = tok.ids("▁Hello")
    st = RequestOutputState.create(SamplingParams(), list(sequence_ids), tok, sequence_ids)
    feed(st, tok.ids("▁world") + [EOS], eos_token_ids=[EOS])
    assert sequence_ids == tok.ids("▁Hello", "▁world") + [EOS] and st.token_ids == tok.ids("▁world") + [EOS]
    assert st.finished and st.argmax_only is False


def test_output_ids_are_read_without_walking_the_prompt():
    """A step reads a sequence's outputs (the sampler's penalties, each streamed output): never by stepping over its
    prompt's ids, which a 1M-token prompt makes milliseconds a step."""
    from hybridkv.engine.output_processing import OutputTokenIds

    class Unwalkable(list):
        def __iter__(self):
            raise AssertionError("iterated the whole list of ids, prompt included")

    ids = Unwalkable([5, 6, 7, 8])
    out = OutputTokenIds(ids, 2)
    assert list(out) == [7, 8] and out[-1] == 8 and out[0:1] == [7] and len(out) == 2
    out.append(9)
    assert list(out) == [7, 8, 9] and list.__len__(ids) == 5
