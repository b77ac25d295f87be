"""A long text's one tokenization read a piece at a time (modules/long_text.py, what the server's chunking reads):
the same ids, spans, head and tail as document() reads whole, for WordPiece, Metaspace BPE, byte-level BPE and a
tokenizer without a pre-tokenizer whose normalizer prepends "▁" (Llama 2's), with and without a prompt, over long
words, whitespace runs and unicode, in pieces small enough to cut each text many times. A tokenizer whose tokens run
from one word into the next is refused pieces, naming why, and read whole."""

import random

import pytest
from builders import make_texts, train_tokenizer
from helpers import minilm_path
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from st_fastbackend.modules.long_text import DocumentReader
from st_fastbackend.modules.tokenizer import TextTokenizer

SPECIAL = ["<unk>", "<s>", "</s>"]
EXTRA = ["héllo", "naïve", "日本語の", "!!", "a,b", "👍", "x\ty", "  ", "\n\n", "C++", "e.g.", "don't", "ﬁne"]
LONG_WORDS = [
    "   \t ",
    "x" * 150,
    "Donaudampfschifffahrtsgesellschaftskapitän" * 3,
    "!" * 90,
    "ğüşçö" * 20,
    "a\u0301e",
]
LLAMA = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])


def _trained(normalizer, pre_tokenizer, template: str, add_eos: bool = False, trained_with=None) -> TextTokenizer:
    """A BPE trained with `trained_with` (else `pre_tokenizer`), then used with `normalizer` and `pre_tokenizer`."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, trained_with or pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(make_texts(500, seed=2, max_words=30)[2:], trainer)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer.decoder = decoders.ByteLevel() if alphabet else decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=100_000)  # fmt: skip
    return TextTokenizer(fast, False, add_eos)


def tokenizers() -> dict:
    return {
        "wordpiece": lambda: TextTokenizer(AutoTokenizer.from_pretrained(minilm_path()), False, False),
        "metaspace": lambda: TextTokenizer(train_tokenizer(), False, False),
        "byte-level": lambda: _trained(None, pre_tokenizers.ByteLevel(add_prefix_space=False), "$A </s>"),
        # Llama 2's: sentencepiece trained it on words, tokenizer.json has no pre-tokenizer
        "no pre-tokenizer, '▁' prepended, EOS added": lambda: _trained(
            LLAMA, None, "<s> $A", add_eos=True, trained_with=pre_tokenizers.Metaspace()
        ),
    }


def text(rng: random.Random, words: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(100, 400)):
        parts += [rng.choice(words), rng.choice([" ", " ", " ", "  ", "\n", ", ", ""])]
    return "".join(parts)


@pytest.mark.parametrize("name", list(tokenizers()))
def test_read_a_piece_at_a_time_it_is_the_whole_texts_tokenization(name):
    texts, rng = tokenizers()[name](), random.Random(3)
    words = " ".join(make_texts(80, seed=9)).split() + EXTRA + LONG_WORDS
    checked = 0
    for trial in range(24):
        long, prompt = text(rng, words), [None, "query:", "Instruct: find it\nQuery:"][trial % 3]
        expected = texts.document(long, prompt)
        reader = DocumentReader(texts, long, prompt, piece_chars=[24, 60, 300][trial % 3], max_word_chars=4000)
        steps = 0
        while not reader.done:
            assert reader.step() > 0
            steps += 1
        assert reader.document() == expected
        checked += steps > 3
    assert checked > 12  # most texts were read in several pieces


def test_a_word_past_the_bound_is_named():
    """BERT splits '!!!' into words; Metaspace does not: 5,000 '!' are one word, past a bound of 2,000 characters."""
    texts = TextTokenizer(train_tokenizer(), False, False)
    reader = DocumentReader(texts, "start " + "!" * 5_000 + " end", None, piece_chars=500, max_word_chars=2_000)
    with pytest.raises(ValueError, match="of over 2,000 characters begins at character 5, and a long text is read"):
        while not reader.done:
            reader.step()


def _roberta() -> TextTokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(make_texts(500, seed=2, max_words=30)[2:], trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 1), trim_offsets=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=100_000)  # fmt: skip
    return TextTokenizer(fast, False, False)


@pytest.mark.parametrize(
    "name, why",
    [
        # Trained without a pre-tokenizer, a BPE learns tokens such as "w▁" that end past a word: the tokens before a
        # cut may then change with what follows it
        ("no pre-tokenizer, tokens across words", "tokens that run from a word into the whitespace after it"),
        # RoBERTa's spans of " foo" begin at "f": a piece cannot be started where its word begins
        ("RoBERTa, trim_offsets", "trims the whitespace off its tokens' spans"),
    ],
)
def test_a_tokenizer_the_premise_fails_for_reads_the_text_whole(name, why):
    """Pieces are refused naming why, and the text is read whole: document()'s tokens, never others."""
    texts = _roberta() if "RoBERTa" in name else _trained(LLAMA, None, "<s> $A", add_eos=True)
    long = text(random.Random(5), " ".join(make_texts(80, seed=9)).split())
    with pytest.raises(ValueError, match=f"cannot read a text a piece at a time: .*{why}"):
        DocumentReader(texts, long, None, piece_chars=60, max_word_chars=4000)
    reader = DocumentReader(texts, long, None, piece_chars=None, max_word_chars=4000)
    assert reader.step() == len(long) and reader.done
    assert reader.document() == texts.document(long)
