"""The embedded task's tokenizer, built locally with the `tokenizers` library: one token per
printable ASCII character, newline and tab (any such text round-trips, nothing needs <unk>),
the word "answer", and four special tokens; a fixed vocabulary of 102 ids on every machine.
`tok(text)` prepends <s>; responses end with </s>; decoding with skip_special_tokens=True gives
back the exact text.
"""
from __future__ import annotations

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
WORDS = ("answer",)  # whole-word tokens, matched before single characters
CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + WORDS + CHARS
assert len(set(VOCAB)) == len(VOCAB) and len(VOCAB) < 128


def make_word_level() -> Tokenizer:
    """The raw `tokenizers.Tokenizer`: WordLevel over VOCAB, words first, then single characters."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    pattern = "|".join(WORDS) + r"|[\s\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate pieces as they are
    bos_id = VOCAB.index(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, bos_id)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The Hugging Face tokenizer, in memory."""
    return PreTrainedTokenizerFast(
        tokenizer_object=make_word_level(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def build_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Build the tokenizer, save it in Hugging Face format into `folder`, and return it."""
    tok = make_tokenizer()
    os.makedirs(folder, exist_ok=True)
    tok.save_pretrained(str(folder))
    # transformers 5 writes its internal class name; the public alias loads in 4.x and 5.x alike.
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return tok


def decode_ids(ids) -> str:
    """Decode ids of this vocabulary without a tokenizer object; special and unknown ids are dropped."""
    out = []
    for i in ids:
        i = int(i)
        if 0 <= i < len(VOCAB) and VOCAB[i] not in SPECIAL_TOKENS:
            out.append(VOCAB[i])
    return "".join(out)
