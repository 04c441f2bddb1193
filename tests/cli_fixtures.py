"""Small random checkpoints for the CLI tests.

`make_checkpoint(path)` writes a MiMo-layout HF folder (config.json, model.safetensors,
tokenizer.json): vocab 100, hidden 32, 2 layers, 3 MTP modules, f32, random weights.
The tokenizer is a byte-level BPE trained on a few strings so that text prompts encode to
ids inside the vocabulary. `make_orbax(hf_path, path)` copies it into an orbax folder.
"""

from __future__ import annotations

import os

from flax import nnx

VOCAB = 100
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and verifies them",
    "hello world, hello jax",
    "one two three four five six seven eight nine ten",
]


def model_config(num_mtp: int = 3, max_position_embeddings: int = 256):
    from mtp_jax.config import ModelConfig

    return ModelConfig(layout="mimo", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=max_position_embeddings,
                       attention_bias=True, num_mtp_modules=num_mtp, dtype="float32")


def make_tokenizer():
    """A byte-level BPE with at most VOCAB ids (the EOS-free test model needs none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Fewer than the 256 byte symbols would fit in VOCAB, so no full byte alphabet: the
    # alphabet is the characters of the corpus, which is all the tests encode.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                  initial_alphabet=[], special_tokens=[])
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok


def make_checkpoint(path: str, *, num_mtp: int = 3, tokenizer: bool = True, seed: int = 0):
    """Write a random HF-layout checkpoint into `path`; returns the loaded-equivalent Model."""
    from mtp_jax.checkpoint import Model, save_hf
    from mtp_jax.mtp import init_model

    cfg = model_config(num_mtp)
    graphdef, params = nnx.split(init_model(cfg, seed=seed))
    model = Model(cfg, graphdef, params, tokenizer=make_tokenizer() if tokenizer else None)
    save_hf(model, path)
    if model.tokenizer is not None:
        model.tokenizer.save(os.path.join(path, "tokenizer.json"))
    return model


def make_orbax(model, path: str) -> None:
    from mtp_jax.checkpoint import save_orbax

    save_orbax(model, path)
