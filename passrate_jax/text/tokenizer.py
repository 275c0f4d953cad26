"""Tokenizers: the built-in character tokenizer and a wrapper over a Hugging Face ``tokenizer.json``.

    tok = load_tokenizer(None)                      # CharTokenizer for the built-in arithmetic tasks
    tok = load_tokenizer("/ckpt/Qwen2.5-0.5B")      # HFTokenizer, no hub access
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+30="}])
    ids = tok.encode(prompt)

Both classes share one duck-typed interface (:class:`Tokenizer`), so callers need no special case.
``HFTokenizer.apply_chat_template`` renders the checkpoint's Jinja chat template the way
``transformers`` does (same sandbox, options, globals and filters), so prompts match
``AutoTokenizer.apply_chat_template(..., tokenize=False)`` without depending on ``transformers``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jinja2
import tokenizers

from passrate_jax.text.chat_template import Message, compile_chat_template, plain, prepare_messages

# The seven named special tokens transformers exposes as template variables, in its order.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer; both :class:`CharTokenizer` and :class:`HFTokenizer` satisfy it."""

    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None
    stop_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...
    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str: ...


# Character tokenizer


class CharTokenizer:
    """One id per character: pad 0, bos 1, eos 2, "\\n" 3, then printable ASCII " ".."~" as 4..98.

    ``vocab_size`` is 99, which fits the built-in model's 128-row embedding.
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    _SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>")
    _CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self) -> None:
        self._char_to_id = {c: i + len(self._SPECIAL_NAMES) for i, c in enumerate(self._CHARS)}
        self.vocab_size: int = len(self._SPECIAL_NAMES) + len(self._CHARS)
        self.stop_ids: tuple[int, ...] = (self.eos_id,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of ``text``, one per character, with ``bos_id`` first when ``add_bos``.

        Raises ValueError naming the first character outside "\\n" and printable ASCII and its index.
        """
        ids = [self.bos_id] if add_bos else []
        table = self._char_to_id
        for pos, ch in enumerate(text):
            i = table.get(ch)
            if i is None:
                raise ValueError(f"CharTokenizer cannot encode character {ch!r} at position {pos}: only '\\n' "
                                 "and printable ASCII (space..~) are in its vocabulary")
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``; pad/bos/eos are dropped when ``skip_special``, else written as ``<pad>``/``<bos>``/``<eos>``.

        Raises ValueError for an id outside ``[0, vocab_size)``.
        """
        n_special = len(self._SPECIAL_NAMES)
        out = []
        for pos, i in enumerate(ids):
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer: id {i} at position {pos} is outside [0, {self.vocab_size})")
            if i < n_special:
                if not skip_special:
                    out.append(self._SPECIAL_NAMES[i])
            else:
                out.append(self._CHARS[i - n_special])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render ``messages`` as ``"{role}: {content}\\n"`` per message, then ``"assistant: "`` when
        ``add_generation_prompt``. Content may be a string or a list of ``{"type": "text", "text": ...}`` blocks.

        ``tools`` and other keyword arguments are accepted for interface parity and ignored: the built-in
        tasks have no tool calls.
        """
        del tools, kwargs
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation")
        parts = []
        for m in messages:
            content = m.get("content") or ""
            if not isinstance(content, str):  # content blocks: keep the text ones, in order
                content = "".join(b.get("text", "") for b in content if b.get("type", "text") == "text")
            parts.append(f"{m['role']}: {content}\n")
        if add_generation_prompt:
            parts.append("assistant: ")
        return "".join(parts)


# Hugging Face tokenizer


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> tokenizers.AddedToken:
    if isinstance(value, Mapping):
        flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return tokenizers.AddedToken(value["content"], special=True, **flags)
    return tokenizers.AddedToken(value, special=True, normalized=False)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class HFTokenizer:
    """A Hugging Face tokenizer (``tokenizer.json``) with its special tokens and chat template.

    Build it with :meth:`from_directory`. ``vocab_size`` counts added tokens; a model's embedding may have
    more rows (padding), never fewer.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_id: int, pad_id: int, bos_id: int | None,
                 stop_ids: Sequence[int], special_tokens: Mapping[str, str],
                 chat_template: str | Mapping[str, str] | None) -> None:
        """Wrap an already-configured ``tokenizers.Tokenizer``; ``special_tokens`` maps names such as
        ``"eos_token"`` to token text (they become chat-template variables); ``chat_template`` is one Jinja
        source or a dict of named ones (``"default"``, ``"tool_use"``, ...)."""
        self._tok = tokenizer
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in (self.eos_id, *stop_ids)))
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load ``tokenizer.json`` from a checkpoint directory, with special tokens from tokenizer_config.json
        (or special_tokens_map.json), stop ids from generation_config.json and the chat template from
        chat_template.jinja + additional_chat_templates/*.jinja, else tokenizer_config.json's ``chat_template``.

        Raises FileNotFoundError naming ``path`` when it has no tokenizer.json, ValueError when no EOS token
        can be found.
        """
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"tokenizer directory {path!r} has no tokenizer.json")
        tok = tokenizers.Tokenizer.from_file(tok_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        if "added_tokens_decoder" not in config:
            # Legacy layout: transformers then lets special_tokens_map.json override the config's entries.
            config = {**config, **_read_json(os.path.join(path, "special_tokens_map.json"))}

        # Named tokens, then model-specific "*_token" entries (e.g. image_token): all become template variables.
        raw = {k: config[k] for k in _NAMED_SPECIAL if _token_text(config.get(k)) is not None}
        raw.update({k: v for k, v in config.items()
                    if k.endswith("_token") and k not in raw and k not in _NAMED_SPECIAL and isinstance(v, str)})
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, Mapping):
            raw.update(extra)
            extra = []
        # transformers registers every special token as a special added token (appending ids for ones the
        # vocabulary lacks); doing the same keeps encode/decode(skip_special) identical.
        to_add = [v for v in (*raw.values(), *extra) if _token_text(v) is not None]
        if to_add:
            tok.add_special_tokens([_added_token(v) for v in to_add])
        special = {k: _token_text(v) for k, v in raw.items() if _token_text(v) is not None}

        def tid(name: str) -> int | None:
            return tok.token_to_id(special[name]) if name in special else None

        gen_eos = _id_list(gen.get("eos_token_id"))
        eos_id = tid("eos_token")
        if eos_id is None:
            eos_id = gen_eos[0] if gen_eos else None
        if eos_id is None:
            raise ValueError(f"tokenizer directory {path!r}: no eos_token in tokenizer_config.json and no "
                             "eos_token_id in generation_config.json")
        pad_id = tid("pad_token")
        if pad_id is None:
            pad_ids = _id_list(gen.get("pad_token_id"))
            # Padding is always masked out, so reusing EOS is safe when the checkpoint names no pad token.
            pad_id = pad_ids[0] if pad_ids else eos_id
        return cls(tok, eos_id=eos_id, pad_id=pad_id, bos_id=tid("bos_token"), stop_ids=gen_eos,
                   special_tokens=special, chat_template=_load_chat_template(path, config))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` (special-token text such as ``<|im_start|>`` maps to its id; no post-processor
        tokens are added), with ``bos_id`` first when ``add_bos`` and the tokenizer has a BOS token."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``, leaving out special tokens when ``skip_special``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (e.g. ``"<|im_end|>"``), None when absent."""
        return self._tok.token_to_id(token)

    def get_chat_template(self, tools: Sequence[Any] | None = None) -> str:
        """The Jinja source used for rendering: the single template, or from a dict of named templates
        ``"tool_use"`` when ``tools`` are given and it exists, else ``"default"``."""
        t = self.chat_template
        if t is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja)")
        if isinstance(t, Mapping):
            if tools is not None and "tool_use" in t:
                return t["tool_use"]
            if "default" in t:
                return t["default"]
            raise ValueError(f"several chat templates and none named 'default': {sorted(t)}")
        return t

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, *,
                            documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render one conversation to text, equal to transformers'
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=..., tools=..., **kwargs)``.

        ``tools`` are JSON-schema dicts (transformers' conversion of Python callables is not reproduced);
        ``kwargs`` become template variables (e.g. ``enable_thinking=False``) and override the special-token
        variables (``bos_token``, ``eos_token``, ...). The text already holds any BOS the template writes,
        so encode it with ``add_bos=False``.
        """
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TypeError("tools must be JSON-schema dicts")
        source = self.get_chat_template(tools)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = compile_chat_template(source)
        variables = plain({**self.special_tokens, **kwargs})
        return template.render(messages=prepare_messages(messages), tools=plain(tools),
                               documents=plain(documents), add_generation_prompt=add_generation_prompt,
                               **variables)


def _load_chat_template(path: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Chat template(s) of a checkpoint. Separate .jinja files take priority over tokenizer_config.json, as in
    transformers; a config list of ``{"name", "template"}`` entries becomes a dict."""
    templates: dict[str, str] = {}
    main = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(main):
        with open(main, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    t = config.get("chat_template")
    if isinstance(t, (list, tuple)):
        return {e["name"]: e["template"] for e in t}
    return t if isinstance(t, str) else None


def load_tokenizer(path: str | os.PathLike | None) -> CharTokenizer | HFTokenizer:
    """The built-in :class:`CharTokenizer` when ``path`` is None, else :meth:`HFTokenizer.from_directory`.

    Raises FileNotFoundError naming ``path`` when it is not a directory or has no tokenizer.json.
    """
    if path is None:
        return CharTokenizer()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {os.fspath(path)!r} is not a directory")
    return HFTokenizer.from_directory(path)
