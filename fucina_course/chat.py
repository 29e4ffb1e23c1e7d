"""Chat is a text protocol: messages rendered into one string by the model's own template.

An instruct model was trained on conversations laid out with marker tokens.  Qwen (and SmolLM2)
use ChatML:

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n
    <|im_start|>assistant\\n

and the model answers by continuing the string until it emits `<|im_end|>`.  The template ships in
the GGUF (`tokenizer.chat_template`, Jinja2); we render it in a sandbox.  A file without one gets
plain ChatML.  The rendered text is encoded with `encode_raw`: the template owns every structural
token, including any BOS.
"""

from __future__ import annotations

from .errors import FucinaError

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise FucinaError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(tokenizer.chat_template or CHATML)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=tokenizer.decode([tokenizer.bos_id]) if tokenizer.bos_id is not None else "",
                               eos_token=tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else "")
    except jinja2.TemplateError as e:
        raise FucinaError(f"cannot render the model's chat template: {e}") from None


def render_prompt(tokenizer, user: str, system: str | None = None) -> str:
    """One user turn (optionally after a system message), ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render(tokenizer, messages)
