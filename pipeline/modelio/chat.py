"""Chat formatting shared by collect and eval: the target's own template and stop tokens."""
from __future__ import annotations

import torch


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Every id that ends a chat turn: the tokenizer's EOS, the generation config's EOS ids, and
    the template's end-of-turn marker when present (SmolLM2 and Qwen use `<|im_end|>`)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    vocab = tokenizer.get_vocab()
    ids = [tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos]),
           *(vocab.get(marker) for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>"))]
    return sorted({int(i) for i in ids if i is not None})


def messages_for(prompt: dict, answers: list[str], turn: int) -> list[dict]:
    """Messages for user turn `turn` of `prompt`, earlier turns answered by `answers` (the
    target's own replies, so later turns are conditioned on what the target actually said)."""
    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    for i in range(turn):
        messages += [{"role": "user", "content": prompt["turns"][i]},
                     {"role": "assistant", "content": answers[i]}]
    messages.append({"role": "user", "content": prompt["turns"][turn]})
    return messages


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Token ids [1, T] of `messages` rendered with the tokenizer's chat template, ready for the
    assistant's reply. Falls back to plain text when a tokenizer has no template."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
