"""Tokenizers: CharTokenizer properties, and HFTokenizer checked against transformers on tokenizers built here."""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passrate_jax.text.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

# ---------------------------------------------------------------------------------------------------------
# CharTokenizer
# ---------------------------------------------------------------------------------------------------------

CHAR_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


def test_char_special_ids_and_vocab():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(CHAR_ALPHABET) <= 128
    assert tok.stop_ids == (2,)
    assert tok.encode("\n") == [3] and tok.encode(" ~") == [4, tok.vocab_size - 1]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=CHAR_ALPHABET, max_size=64), add_bos=st.booleans())
def test_char_round_trip(text, add_bos):
    tok = CharTokenizer()
    ids = tok.encode(text, add_bos=add_bos)
    assert len(ids) == len(text) + add_bos
    assert all(3 <= i < tok.vocab_size for i in ids[add_bos:])
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == ("<bos>" if add_bos else "") + text


def test_char_unknown_character_names_char_and_position():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"'é' at position 3"):
        tok.encode("abcé")
    with pytest.raises(ValueError, match=r"'\\t' at position 0"):
        tok.encode("\tx")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


def test_char_chat_template():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "be exact"}, {"role": "user", "content": "12+30="}]
    assert tok.apply_chat_template(msgs) == "system: be exact\nuser: 12+30=\nassistant: "
    msgs.append({"role": "assistant", "content": [{"type": "text", "text": "42"}]})
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert text.endswith("assistant: 42\n")
    assert tok.decode(tok.encode(text)) == text


def test_load_tokenizer_none_and_bad_paths(tmp_path):
    assert isinstance(load_tokenizer(None), CharTokenizer)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(str(missing))


# ---------------------------------------------------------------------------------------------------------
# HFTokenizer vs transformers
# ---------------------------------------------------------------------------------------------------------

CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content is defined %}
            {{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}
        {%- endif %}
        {% generation %}{{- message.content }}{% endgeneration %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson(sort_keys=true) }}
        {{- "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "12 + 30 = 42, carry the one.", "def f(x):\n    return x * 2",
    "Café crème, naïve façade — ünïcödé 文字.", "<b>bold</b> & 'quotes' \"double\"", "Step 1: add the units.",
] * 5

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _train_bpe(special):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _save(directory, tok, generation_eos, save_jinja_files=True, **kwargs):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    hf.save_pretrained(str(directory), save_jinja_files=save_jinja_files)
    ids = [hf.convert_tokens_to_ids(t) for t in generation_eos]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Three checkpoint directories: ChatML (template in chat_template.jinja), Llama 3 (template inside
    tokenizer_config.json, with a BOS token) and ChatML with a dict of named templates."""
    base = tmp_path_factory.mktemp("tok")
    qwen = _save(base / "qwen", _train_bpe(QWEN_SPECIAL), ["<|im_end|>", "<|endoftext|>"],
                 eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)
    llama = _save(base / "llama", _train_bpe(LLAMA_SPECIAL), ["<|end_of_text|>", "<|eot_id|>"],
                  save_jinja_files=False, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                  chat_template=LLAMA3_TEMPLATE)
    multi = _save(base / "multi", _train_bpe(QWEN_SPECIAL), ["<|im_end|>"], eos_token="<|im_end|>",
                  chat_template={"default": CHATML_TEMPLATE, "tool_use": LLAMA3_TEMPLATE})
    return {"qwen": qwen, "llama": llama, "multi": multi}


def _hf(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <a> & <b>, café",
                                           "parameters": {"type": "object", "properties": {
                                               "b": {"type": "integer"}, "a": {"type": "integer"}}}}}]

CONVERSATIONS = [
    ([{"role": "user", "content": "What is 12+30?"}], {}),
    ([{"role": "system", "content": "Be exact."}, {"role": "user", "content": "  <b>&'\"é\n  indented  "}], {}),
    ([{"role": "system", "content": "Be exact."}, {"role": "user", "content": "12+30?"},
      {"role": "assistant", "content": "42", "tool_calls": None}, {"role": "user", "content": "and 1+1?"}], {}),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning": "greet back"}],
     {"enable_thinking": False}),
    ([{"role": "user", "content": "Add 2 and 3."},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "add", "arguments": {"b": 3, "a": 2}}}]},
      {"role": "tool", "content": "5"}], {"tools": TOOLS}),
]


@pytest.mark.parametrize("name", ["qwen", "llama", "multi"])
def test_hf_chat_template_matches_transformers(dirs, name):
    ours, ref = HFTokenizer.from_directory(dirs[name]), _hf(dirs[name])
    for messages, kwargs in CONVERSATIONS:
        if name != "qwen":
            kwargs = {**kwargs, "date_string": "26 Jul 2024"}
        for add_gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **kwargs)
            got = ours.apply_chat_template(messages, add_generation_prompt=add_gen, **kwargs)
            assert got == expected, (name, messages, add_gen)
            assert ours.encode(got) == ref.encode(expected, add_special_tokens=False)


def test_hf_strftime_now_and_raise_exception(dirs):
    ours, ref = HFTokenizer.from_directory(dirs["llama"]), _hf(dirs["llama"])
    messages = [{"role": "user", "content": "date?"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages).startswith("<|begin_of_text|>")
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]}]
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        ours.apply_chat_template(two_calls)
    with pytest.raises(ValueError, match="empty"):
        ours.apply_chat_template([])


TEXTS = ["", "The quick brown fox.", "12 + 30 = 42\n\nStep 2:", "Café 文字 ünïcödé!", "  leading  and trailing  ",
         "<|im_start|>user\nhi<|im_end|>\n", "<|begin_of_text|><|start_header_id|>x<|end_header_id|>", "<|eot_id|>"]


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_hf_encode_decode_match_transformers(dirs, name):
    ours, ref = HFTokenizer.from_directory(dirs[name]), _hf(dirs[name])
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip), text
        with_bos = ours.encode(text, add_bos=True)
        assert with_bos == ([ref.bos_token_id] if ref.bos_token_id is not None else []) + ids


def test_hf_special_ids(dirs):
    qwen, llama = HFTokenizer.from_directory(dirs["qwen"]), HFTokenizer.from_directory(dirs["llama"])
    q = {t: qwen.token_to_id(t) for t in QWEN_SPECIAL}
    assert qwen.bos_id is None
    assert (qwen.eos_id, qwen.pad_id) == (q["<|im_end|>"], q["<|endoftext|>"])
    assert qwen.stop_ids == (q["<|im_end|>"], q["<|endoftext|>"])
    lm = {t: llama.token_to_id(t) for t in LLAMA_SPECIAL}
    assert (llama.bos_id, llama.eos_id) == (lm["<|begin_of_text|>"], lm["<|eot_id|>"])
    assert llama.pad_id == llama.eos_id  # no pad token named: falls back to EOS
    assert set(llama.stop_ids) == {lm["<|eot_id|>"], lm["<|end_of_text|>"]} and llama.stop_ids[0] == llama.eos_id
    assert isinstance(load_tokenizer(str(dirs["llama"])), HFTokenizer)


def test_hf_legacy_layout(dirs, tmp_path):
    """Template as a config list of named entries, tokens from special_tokens_map.json, no generation config."""
    (tmp_path / "tokenizer.json").write_text((dirs["qwen"] / "tokenizer.json").read_text())
    config = {"chat_template": [{"name": "default", "template": CHATML_TEMPLATE},
                                {"name": "tool_use", "template": LLAMA3_TEMPLATE}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False}, "bos_token": "<|endoftext|>"}))
    tok = HFTokenizer.from_directory(tmp_path)
    assert tok.eos_id == tok.pad_id == tok.token_to_id("<|im_end|>")
    assert tok.bos_id == tok.token_to_id("<|endoftext|>") and tok.stop_ids == (tok.eos_id,)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs).startswith("<|im_start|>system")
    assert tok.apply_chat_template(msgs, tools=TOOLS, date_string="1 Jan 2025").startswith("<|endoftext|>")
    no_template = tmp_path / "bare"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_text((dirs["qwen"] / "tokenizer.json").read_text())
    (no_template / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    bare = HFTokenizer.from_directory(no_template)
    assert bare.eos_id == 2 and bare.bos_id is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(msgs)


def test_hf_registers_config_special_tokens_like_transformers(dirs, tmp_path):
    """Special tokens named only in tokenizer_config.json are added to the vocabulary, as transformers does."""
    (tmp_path / "tokenizer.json").write_text((dirs["qwen"] / "tokenizer.json").read_text())
    config = {"eos_token": "<|im_end|>", "pad_token": "<|pad|>", "extra_special_tokens": ["<|tool|>"],
              "image_token": "<|image|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = HFTokenizer.from_directory(tmp_path), _hf(tmp_path)
    assert ours.vocab_size == len(ref) and ours.pad_id == ref.pad_token_id
    text = "a<|pad|>b <|tool|> <|image|>c"
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "ab  c"
    assert ours.special_tokens["image_token"] == "<|image|>"
