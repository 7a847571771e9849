"""Tokenizers with the chat format of real model families, built in process (no download).

Each family (tests/data/chat_templates/families.json) gets a byte-level BPE trained on the
tiny model's corpus, with the family's own special tokens, added tokens, eos/bos/pad and
its real chat template, so tests exercise every real template and special-token layout.
The vocabulary is not the family's (ids differ; text tokenizes differently), which is all a
chat-format test needs. `generation_config` gives the family's generation-config eos ids.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from artrl.models.tiny import _corpus_text

DATA = pathlib.Path(__file__).parent / "data" / "chat_templates"
FAMILIES: dict[str, dict[str, Any]] = {k: v for k, v in json.loads((DATA / "families.json").read_text()).items()
                                       if not k.startswith("_")}
VOCAB_SIZE = 1024


@functools.cache
def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    spec = FAMILIES[name]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=list(spec["special"]),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = _corpus_text().splitlines(keepends=True)
    backend.train_from_iterator(lines, trainer=trainer, length=len(lines))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=spec["bos_token"], eos_token=spec["eos_token"],
        pad_token=spec["pad_token"], unk_token=None, clean_up_tokenization_spaces=False,
        chat_template=(DATA / spec["template"]).read_text(),
    )


def generation_config(name: str) -> GenerationConfig:
    tok = family_tokenizer(name)
    return GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids(t) for t in FAMILIES[name]["generation_eos"]])
