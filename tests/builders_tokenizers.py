"""Character-level tokenizers in the Hub layout for the tiny test checkpoints
(re-exported by tests.builders): a WordLevel tokenizer over single characters
with each family's special tokens at their (scaled-down) ids and a chat
template in the family's style. The demo training scripts (demo/train_*.py)
build their tokenizers with the same functions, so the bundled demo
checkpoints share these vocabularies."""

from __future__ import annotations

from pathlib import Path

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?+-*/=()[]{}<>'\"\n_#@%&|"


def _build_char_tokenizer(out_dir: str | Path, vocab_size: int, special_tokens: dict[int, str],
                          chat_template: str, add_bos_token: bool | None = None,
                          extra_special_tokens: dict | None = None, **named_tokens) -> None:
    """Write tokenizer.json / tokenizer_config.json / chat_template.jinja for a WordLevel
    tokenizer over single characters: the special tokens at their ids, then CHARS on the
    free ids, then ``<unusedN>`` for the rest (so every id decodes to something).
    ``named_tokens`` (bos_token=..., eos_token=...) give special tokens their roles; the
    other special tokens become additional special tokens; ``extra_special_tokens``
    names more of them (Gemma 4's image_token / boi_token / eoi_token)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {tok: i for i, tok in special_tokens.items()}
    free = (i for i in range(vocab_size) if i not in special_tokens)
    for ch in CHARS:
        vocab[ch] = next(free)
    for i in free:
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    named = set(named_tokens.values()) | set((extra_special_tokens or {}).values())
    extra = {"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, **named_tokens, **extra,
        additional_special_tokens=[t for _, t in sorted(special_tokens.items()) if t not in named],
    )
    fast.chat_template = chat_template
    if add_bos_token is not None:
        fast.add_bos_token = add_bos_token
    fast.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------
# DiffusionGemma
# ---------------------------------------------------------------------------

# Gemma 4 special-token ids that dlm relies on (google/diffusiongemma-26B-A4B-it's tokenizer.json).
DG_SPECIAL_TOKENS = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>",
    48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 52: '<|"|>',
    98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
}
# Gemma 4's image tokens (the release: boi 255999, image 258880, eoi 258882), at
# the tiny config's ids; the processor expands each image token to boi + n x image + eoi.
DG_IMAGE_TOKENS = {500: "<|image|>", 501: "<|image>", 502: "<image|>"}
DG_IMAGE_NAMES = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"}
DG_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set msgs = messages %}"
    "{% if enable_thinking is defined and enable_thinking %}<|turn>system\n<|think|>"
    "{% if msgs and msgs[0]['role'] == 'system' %}{{ msgs[0]['content'] }}{% set msgs = msgs[1:] %}{% endif %}"
    "<turn|>\n"
    "{% elif msgs and msgs[0]['role'] == 'system' %}<|turn>system\n{{ msgs[0]['content'] }}<turn|>\n"
    "{% set msgs = msgs[1:] %}{% endif %}"
    "{% for m in msgs %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def build_diffusion_gemma_tokenizer(vocab_size: int, out_dir: str | Path) -> None:
    """The Gemma-4-style character tokenizer (no BOS added on encode; the template adds it),
    with Gemma 4's image tokens when the vocabulary holds their tiny ids."""
    special, names = dict(DG_SPECIAL_TOKENS), None
    if vocab_size > max(DG_IMAGE_TOKENS):
        special.update(DG_IMAGE_TOKENS)
        names = DG_IMAGE_NAMES
    _build_char_tokenizer(out_dir, vocab_size, special, DG_CHAT_TEMPLATE, add_bos_token=False,
                          extra_special_tokens=names, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                          unk_token="<unk>")


# ---------------------------------------------------------------------------
# LLaDA2.0 MoE
# ---------------------------------------------------------------------------

LLADA2_EOS_ID = 252
LLADA2_ROLE_END_ID = 253
LLADA2_MASK_ID = 255
LLADA2_SPECIAL_TOKENS = {
    248: "<unk>", 249: "<|startoftext|>", 250: "<role>", 251: "</role>",
    LLADA2_EOS_ID: "<|endoftext|>", LLADA2_ROLE_END_ID: "<|role_end|>", 254: "<|arithmetic_start|>",
    LLADA2_MASK_ID: "<|mask|>",
}
LLADA2_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set role = {'user': 'HUMAN', 'assistant': 'ASSISTANT', 'system': 'SYSTEM'}"
    ".get(m['role'], m['role'] | upper) -%}"
    "<role>{{ role }}</role>{{ m['content'] }}<|role_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- endif -%}"
)


def build_llada2_tokenizer(vocab_size: int, out_dir: str | Path) -> None:
    """The LLaDA-2-style character tokenizer (eos = pad = <|endoftext|>, mask = <|mask|>)."""
    _build_char_tokenizer(out_dir, vocab_size, LLADA2_SPECIAL_TOKENS, LLADA2_CHAT_TEMPLATE,
                          eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>",
                          mask_token="<|mask|>")
