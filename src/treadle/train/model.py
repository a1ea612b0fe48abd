"""The tokenizer and the small Qwen2 model, built from a seed with no downloads.

**Tokenizer.** Byte-level BPE (`tokenizers`) trained on the training transcripts,
with the special tokens ``<|endoftext|>`` (id 0, padding), ``<|im_start|>`` (1) and
``<|im_end|>`` (2, end of a reply). Two choices make the transcripts short and the
task learnable by a tiny model:

- every digit is its own token (`Digits(individual_digits=True)`), so copying a
  number from the question into code is copying digit tokens one by one;
- no whitespace pre-split (`ByteLevel(use_regex=False)`): merges may cross spaces,
  so the constant text of the system prompt, the tool specs and the tool-call
  syntax become a few long tokens. A math prompt is ~60 tokens instead of ~435
  with GPT-2's word split, which makes training and rollouts ~5x cheaper. The
  price: text unlike the transcripts tokenizes poorly (byte-ish), and the
  vocabulary is tied to the agent format of `treadle.agent.chat`.

**Model.** `Qwen2ForCausalLM`, fp32, tied embeddings. The default (`ModelConfig`):
hidden 256, 4 layers, 4 query heads of head_dim 64 with 2 KV heads, MLP 768,
vocabulary 1,024 — 3.4M parameters. head_dim 64 because vLLM's CPU attention
rejects 16; 4 layers because copying needs at least two (an induction circuit)
and a few more carry the per-kind formats; width 256 keeps one SFT step of 32
transcripts near 0.5 s on 2 cores (docs/training.md has the measurements).

A checkpoint directory holds `config.json`, `model.safetensors`,
`generation_config.json` (eos ``<|im_end|>``), `tokenizer.json`,
`tokenizer_config.json` (eos ``<|im_end|>``, pad ``<|endoftext|>``; see
`tokenizer_config`) and `chat_template.jinja`, a chat template that renders
conversations exactly as `HermesFormat` does. `treadle.agent.chat.HFTokenizer(dir)`,
`transformers.AutoTokenizer.from_pretrained(dir)` and vLLM all load it to the same
encoding (`save_tokenizer` checks the installed transformers does).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.agent.chat.hermes import DEFAULT_SYSTEM, IM_END, IM_START, TOOLS_INTRO, TOOLS_OUTRO

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import Qwen2ForCausalLM

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# The Qwen2.5 tool-use template, reduced to what `HermesFormat` renders (system with
# tools, user, assistant with tool calls, tool results in one user turn), so that
# `apply_chat_template` over a conversation equals the agent loop's pieces joined.
# All text is inside {{ }} and no tag is followed by a newline: transformers renders
# with trim_blocks/lstrip_blocks, which would eat literal newlines next to tags.
def _jinja(text: str) -> str:
    return json.dumps(text)  # a Jinja string literal (same escapes as JSON)


CHAT_TEMPLATE = (
    "{% set system = " + _jinja(DEFAULT_SYSTEM) + " %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}{% endif %}"
    "{{ " + _jinja(IM_START + "system\n") + " + system }}"
    "{% if tools %}{{ " + _jinja(TOOLS_INTRO) + " }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ " + _jinja(TOOLS_OUTRO) + " }}{% endif %}"
    "{{ " + _jinja(IM_END + "\n") + " }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ " + _jinja(IM_START + "user\n") + " }}{% else %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ " + _jinja(IM_END + "\n") + " }}{% endif %}"
    "{% else %}"
    "{{ " + _jinja(IM_START) + " + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% for call in m.get('tool_calls') or [] %}"
    "{% set f = call['function'] if 'function' in call else call %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' "
    "+ (f['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ " + _jinja(IM_END + "\n") + " }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ " + _jinja(IM_START + "assistant\n") + " }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture and tokenizer size; see the module docstring for the choice."""

    vocab_size: int = 1024  # BPE target size, special tokens included
    hidden_size: int = 256  # residual width
    layers: int = 4  # transformer blocks
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 768  # SwiGLU MLP width
    max_positions: int = 1024  # longest context (prompt + replies + observations)
    rope_theta: float = 10000.0  # rotary base; contexts here are short

    def __post_init__(self) -> None:
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden_size must be a multiple of heads, heads of kv_heads")
        if self.head_dim < 32:  # "Unsupported CPU attention configuration" in vLLM
            raise ValueError(f"head_dim (hidden_size / heads) must be >= 32, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        """Per-head width, hidden_size / heads (Qwen2 derives it so; vLLM needs >= 32)."""
        return self.hidden_size // self.heads

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `texts` (deterministic: the same texts give the
    same merges). Special tokens take ids 0-2; see the module docstring."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} "
                         f"(special tokens and the 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for want, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != want:  # the ids are part of the checkpoint format
            raise RuntimeError(f"special token {token!r} got id {tok.token_to_id(token)}")
    return tok


def build_model(config: ModelConfig, vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised model; the same (config, vocab_size, seed) gives the same
    weights. `vocab_size` is the trained tokenizer's (it may fall short of the target)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2Config(
        vocab_size=vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.layers,
        num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=PAD_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID, dtype="float32")
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(qwen)  # type: ignore[no-untyped-call]
    return model


def save_checkpoint(model: Qwen2ForCausalLM, tokenizer: Tokenizer, out: str | Path) -> Path:
    """Write the model and the tokenizer (with eos, pad and chat template) to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = IM_END_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(out)  # first: AutoTokenizer reads config.json (save_tokenizer checks)
    save_tokenizer(tokenizer, out, model.config.max_position_embeddings)
    return out


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` of a checkpoint: transformers' view of the tokenizer.

    Written here rather than by `PreTrainedTokenizerFast.save_pretrained`, because what
    that writes loads as a *different* tokenizer: transformers 5.x maps model_type
    ``qwen2`` to `Qwen2Tokenizer` whatever class this file names (qwen2 is in
    `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`), and `Qwen2Tokenizer.__init__` rebuilds
    the pipeline from the vocabulary and merges alone, with Qwen's regex word split
    and an NFC normalizer in place of ours (no split, digits apart): a math question
    became 24 tokens instead of 14. Checked: 4.57, 5.8, 5.10, 5.19 and 5.24 load it as
    written (`save_tokenizer` checks the installed one)."""
    return {
        # 4.x: the generic fast class, which loads tokenizer.json as written (5.x writes
        # "TokenizersBackend", a name 4.x does not have, so its checkpoints fail there).
        "tokenizer_class": "PreTrainedTokenizerFast",
        # 5.x: `TokenizersBackend.convert_to_native_format` keeps tokenizer.json as written
        # (instead of handing only vocab/merges to Qwen2Tokenizer) when it is called with
        # trust_remote_code, and `_from_pretrained` calls it with this file's keys. No code
        # is trusted or run by it: there is no `auto_map`, so there is none to run.
        "trust_remote_code": True,
        "bos_token": None,  # Qwen2 chat models prepend nothing
        "eos_token": IM_END,
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "unk_token": None,  # byte-level: every text encodes, nothing is unknown
        # As Qwen's own tokenizers list them, so all three count as special tokens (e.g.
        # `all_special_ids`) on the Hugging Face side; the name 4.x and 5.x both read.
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,  # decode exactly as tokenizers does
        "model_max_length": model_max_length,
    }


def save_tokenizer(tokenizer: Tokenizer, out: str | Path, model_max_length: int) -> None:
    """Write `tokenizer.json` (`tokenizer` exactly), `tokenizer_config.json`
    (`tokenizer_config`) and `chat_template.jinja` (`CHAT_TEMPLATE`) to `out`, which
    must already hold the model's `config.json`. Then load it back with
    `AutoTokenizer`: RuntimeError if the installed transformers would not encode as
    `tokenizer` does, or names other special tokens (the files stay, for a look)."""
    from transformers import AutoTokenizer

    from treadle.agent.fingerprint import section_digests, tokenizer_fingerprint

    out = Path(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    hf = AutoTokenizer.from_pretrained(str(out))
    if tokenizer_fingerprint(hf) != tokenizer_fingerprint(tokenizer):
        ours, theirs = section_digests(tokenizer), section_digests(hf)
        differ = [name for name in ours if ours[name] != theirs[name]]
        raise RuntimeError(f"transformers loads {out} as a {type(hf).__name__} that encodes "
                           f"differently from tokenizer.json ({', '.join(differ)} differ); "
                           "see treadle.train.model.tokenizer_config")
    specials = (hf.pad_token_id, hf.convert_tokens_to_ids(IM_START), hf.eos_token_id)
    if specials != (PAD_ID, IM_START_ID, IM_END_ID) or hf.bos_token_id is not None:
        raise RuntimeError(f"transformers loads {out} with pad/im_start/eos ids {specials} "
                           f"and bos {hf.bos_token_id}, not {(PAD_ID, IM_START_ID, IM_END_ID)}"
                           " and None")


def load_model(path: str | Path) -> Qwen2ForCausalLM:
    """A saved checkpoint's model, fp32, in eval mode."""
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def weights_digest(model: Qwen2ForCausalLM) -> str:
    """SHA-256 over every parameter's name, shape and fp32 bytes (determinism checks)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
