"""Build a tiny, seeded Qwen2 causal LM with a locally trained tokenizer (no downloads).

Run with the python of `.venv-vllm` (it has torch, transformers, tokenizers):

    .venv-vllm/bin/python tests/engines/tiny_model.py OUT_DIR

Writes `config.json`, safetensors weights and a tokenizer (`tokenizer.json`, a
`tokenizer_config.json` like `treadle.train.model.tokenizer_config`'s, a chat
template) to OUT_DIR, which vLLM serves. Deterministic: the corpus, the BPE merges
and the weights depend only on the seed. Random weights: the text is gibberish, but
token ids, logprobs and finish reasons are real engine output. A few seconds on 2
cores.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What `treadle.train.model.tokenizer_config` writes (this script runs in .venv-vllm,
# which lacks treadle); its docstring says why: without `trust_remote_code`,
# transformers 5.x loads a qwen2 checkpoint's tokenizer as a Qwen2Tokenizer rebuilt
# with Qwen's own pre-tokenizer and normalizer, which encodes differently from
# tokenizer.json (what treadle encodes prompts with).
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True,
    "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "clean_up_tokenization_spaces": False,
}
WORDS = ["the", "agent", "tool", "call", "returns", "a", "result", "model", "token", "reward",
         "rollout", "step", "sandbox", "runs", "tests", "and", "then", "writes", "code", "file",
         "search", "query", "answer", "is", "not", "ok", "error", "retry", "done", "math"]


def corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) + "."
            for _ in range(lines)]


def build(out: Path, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write the model to `out` (created); head_dim is 64 (vLLM's CPU attention
    rejects head_dim 16: "Unsupported CPU attention configuration")."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"), torch_dtype="float32")
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
