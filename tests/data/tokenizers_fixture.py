"""A small BPE tokenizer trained in the test with `tokenizers`, wrapped for transformers, with chat templates.

Nothing is downloaded: the vocabulary is learned from the text given. `MARKED` is a chat template with
`{% generation %}` marks around the assistant's turns; `UNMARKED` renders the same text without them.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
_BODY = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|assistant|>{GEN}{{ m['content'] }}</s>{ENDGEN}\n"
    "{%- else -%}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
MARKED = "{{ bos_token }}" + _BODY.replace("{GEN}", "{% generation %}").replace("{ENDGEN}", "{% endgeneration %}")
UNMARKED = "{{ bos_token }}" + _BODY.replace("{GEN}", "").replace("{ENDGEN}", "")


def train_tokenizer(
    texts: list[str], *, vocab_size: int = 400, template: str | None = MARKED, bos: bool = True, pad: bool = True
):
    """A fast transformers tokenizer: byte-level BPE learned from `texts`, adding BOS itself when `bos`."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        **({"pad_token": "<pad>"} if pad else {}),
    )
    if template is not None:
        fast.chat_template = template
    return fast
