"""Chat templates the user chooses (`--data.chat_template`) and function calling: a row's `tools` and its
messages' `tool_calls` reach the template, only the assistant's spans train, and a row the template cannot
render is one line naming the row and its fields."""

import copy
import json

import pytest

from shardtrain.data.encode import Encoder, Overlong, TrainOn
from shardtrain.data.formats import Format
from shardtrain.data.tokenizer import load_tokenizer, use_chat_template
from tests.data.tokenizers_fixture import MARKED, train_tokenizer

# A function-calling template in the style of the Hub's: the tools as JSON in a system block, each call
# of an assistant turn rendered inside its generation marks, tool results as their own turns, and an
# unknown role refused by raise_exception as transformers' templates do.
TOOLS = (
    "{{ bos_token }}"
    "{%- if tools -%}<|system|>tools: {{ tools | tojson }}\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] is defined -%}{%- for c in m['tool_calls'] -%}"
    "<call>{{ c['function']['name'] }}({{ c['function']['arguments'] | tojson }})</call>"
    "{%- endfor -%}{%- endif -%}</s>{% endgeneration %}\n"
    "{%- elif m['role'] == 'tool' -%}<|tool|>{{ m['name'] }}: {{ m['content'] }}\n"
    "{%- elif m['role'] in ['user', 'system'] -%}<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{%- else -%}{{ raise_exception('unknown role ' + m['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Quelmar"}}}
CALLING = [
    {"role": "user", "content": "What is the weather in Quelmar?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Quelmar."},
]
PLAIN = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hello, friend."}]


@pytest.fixture(scope="module")
def tok():
    texts = [json.dumps(CALLING), json.dumps(WEATHER), json.dumps(PLAIN), "<call></call> tools: sunny"] * 10
    return train_tokenizer(texts, vocab_size=400, template=TOOLS)


def _encode(tok, row):
    encoder = Encoder(tokenizer=tok, format=Format.MESSAGES, train_on=TrainOn.COMPLETION, seq_len=512,
                      overlong=Overlong.TRUNCATE)  # fmt: skip
    return encoder({k: [v] for k, v in row.items()}, [0])


def _spans(tok, ids, trained):
    """The decoded trained text and the decoded rest."""
    kept = tok.decode([t for t, m in zip(ids, trained) if m], skip_special_tokens=False)
    rest = tok.decode([t for t, m in zip(ids, trained) if not m], skip_special_tokens=False)
    return kept, rest


def test_tools_and_tool_calls_reach_the_template_and_only_the_assistant_trains(tok):
    out = _encode(tok, {"messages": CALLING, "tools": [WEATHER]})
    ids, trained = out["input_ids"][0], out["trained"][0]
    kept, rest = _spans(tok, ids, trained)
    assert '<call>get_weather({"city": "Quelmar"})</call>' in kept and "It is sunny in Quelmar." in kept
    assert '"name": "get_weather", "description": "The weather in a city"' in rest  # the tools block
    assert "What is the weather" in rest and "sunny, 21 C" in rest  # user and tool turns never train
    assert "What is the weather" not in kept and "sunny, 21 C" not in kept and "tools:" not in kept
    expected = tok.apply_chat_template(CALLING, tools=[WEATHER], return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(expected["input_ids"]) and trained == list(expected["assistant_masks"])


def test_tools_stored_as_a_json_string_render_alike(tok):
    as_list = _encode(tok, {"messages": CALLING, "tools": [WEATHER]})
    as_string = _encode(tok, {"messages": CALLING, "tools": json.dumps([WEATHER])})
    assert as_string["input_ids"] == as_list["input_ids"] and as_string["trained"] == as_list["trained"]


def test_rows_with_and_without_calls_in_one_parquet_column(tmp_path, tok):
    """Parquet (Arrow) gives one struct schema to a column: a message without tool_calls reads back with
    tool_calls None, and one row's tool schema gets the other's properties as None; the template must see
    them absent, not null."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardtrain.data import DataSpec, prepare

    path = tmp_path / "calls.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"messages": CALLING, "tools": [WEATHER]}, {"messages": PLAIN, "tools": [CLOCK]}] * 4),
        path,
    )
    loaded = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert loaded[1]["messages"][0]["tool_calls"] is None  # the Nones the template must not see
    assert loaded[1]["tools"][0]["function"]["parameters"]["properties"]["city"] is None
    spec = DataSpec(path=str(path), seq_len=512, val_fraction=0.25, packing=False)
    prepared = prepare(spec, tokenizer=tok, cache_dir=str(tmp_path / "cache"), progress=False)
    texts = [tok.decode(ids) for ids in [*prepared.train["input_ids"], *prepared.held_out["input_ids"]]]
    assert not any("null" in t for t in texts), texts
    assert (
        sum("<call>" in t for t in texts) == 4 and sum("Hello, friend." in t and "<call>" not in t for t in texts) == 4
    )


def test_a_row_the_template_cannot_render_names_the_row_and_its_fields(tok):
    row = {"messages": [*PLAIN, {"role": "critic", "content": "too short"}], "tools": None}
    with pytest.raises(ValueError) as err:
        _encode(tok, row)
    message = str(err.value)
    assert message.startswith(
        "data row 0: the chat template cannot render its messages (fields ['content', 'role'], without tools; "
        "first at message 2: role 'critic', fields ['content', 'role'])"
    )
    assert "unknown role critic" in message and "--data.chat_template" in message and "\n" not in message


def test_a_tool_schema_the_template_cannot_render_is_named(tok):
    strict = copy.deepcopy(tok)
    strict.chat_template = TOOLS.replace(
        "{{ tools | tojson }}", "{% for t in tools %}{{ t.function.name + 1 }}{% endfor %}"
    )
    with pytest.raises(
        ValueError, match=r"^data row 0: .*, with tools; at the tools\); fix the row.* \(TypeError: "
    ) as err:
        _encode(strict, {"messages": CALLING, "tools": [WEATHER]})
    assert "\n" not in str(err.value)


def test_a_template_file_or_a_shipped_name_replaces_the_template_and_is_exported(tmp_path, tok):
    folder = tmp_path / "tok"
    shipped = train_tokenizer(["hello world"] * 5, vocab_size=300, template=None)
    shipped.chat_template = {"default": MARKED, "tool_use": TOOLS}
    shipped.save_pretrained(folder)
    assert load_tokenizer(str(folder), key="data.tokenizer", chat_template="tool_use").chat_template == TOOLS
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    chosen = load_tokenizer(str(folder), key="data.tokenizer", chat_template=str(template))
    assert chosen.apply_chat_template(PLAIN, tokenize=False) == "### user: Hello there\n### assistant: Hello, friend.\n"
    chosen.save_pretrained(tmp_path / "exported")  # what the run's export writes beside the model
    assert load_tokenizer(str(tmp_path / "exported"), key="x").chat_template == template.read_text()
    with pytest.raises(ValueError, match=r"^data.chat_template='chatml' is neither a file nor a named template "
                       r"\(the tokenizer ships \['default', 'tool_use'\]\)"):  # fmt: skip
        use_chat_template(shipped, "chatml")
