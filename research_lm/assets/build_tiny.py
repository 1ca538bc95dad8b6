"""Step one of the built-in `tiny-llama`: a byte-level BPE tokenizer trained on the stdlib corpus and a
seeded random-init Llama saved with `transformers.save_pretrained`. Step two trains its weights with
`experiment=train_target` (see assets/README.md). Re-run with `python -m research_lm.assets.build_tiny`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from research_lm.harness.corpus import corpus_hash, stdlib_files

OUT = Path(__file__).parent / "tiny-llama"
VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|pad|>"]


def build_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[0], pad_token=SPECIAL[1])


def build_model(eos_id: int, pad_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def main() -> None:
    files = stdlib_files(limit_bytes=4_000_000)
    tokenizer = build_tokenizer(files)
    model = build_model(tokenizer.eos_token_id, tokenizer.pad_token_id)
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(OUT)
    model.save_pretrained(OUT)
    recipe = {"weights": "random, torch.manual_seed(0)", "tokenizer_corpus_files": len(files),
              "tokenizer_corpus_hash": corpus_hash(files), "vocab_size": VOCAB}
    (OUT / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
