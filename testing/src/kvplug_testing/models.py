"""Models for engines to serve in tests and benchmarks, built here: no model hub is needed.

Example::

    model_dir = build_random_llama(tmp_path / "model")     # then serve it with token-id prompts
"""

from __future__ import annotations

import os
from pathlib import Path


def build_random_llama(
    directory: str | os.PathLike[str],
    *,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Path:
    """Save a Llama-architecture model with random weights (``seed``) in bfloat16 to
    ``directory``, for an engine to serve; returns the directory. It has no tokenizer: prompts
    are token ids. Needs torch and transformers (an engine's venv has both)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return Path(directory)


__all__ = ["build_random_llama"]
