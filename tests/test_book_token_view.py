"""Fast checks of the chapter 01 token display (no model, no kernel, no network)."""

import re

import pytest

from engine_lib.book.token_view import byte_decoder, token_pieces, tokenizer_widget, tokens_html
from engine_lib.model.tokenizer import load_tokenizer, seed_prompts


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def chips(markup: str) -> list[str]:
    return re.findall(r'<span class="tok-chip[^"]*"', markup)


def test_byte_decoder_is_a_bijection():
    table = byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["A"] == ord("A")


def test_every_token_appears_with_its_id(tok):
    text = "Why is the sky blue?"
    ids = tok.encode(text, add_special_tokens=False)
    markup = tokens_html(tok, text)
    assert len(chips(markup)) == len(ids)
    for i in ids:
        assert '<sub class="tok-id"' in markup and f">{i}</sub>" in markup
        assert f"id {i} |" in markup  # tooltip
    assert "".join(p.text for p in token_pieces(tok, text)) == text


def test_ids_input_matches_text_input(tok):
    text = "Hello world"
    assert tokens_html(tok, text) == tokens_html(tok, tok.encode(text, add_special_tokens=False))


def test_special_tokens_are_styled_and_whitespace_visible(tok):
    chat = seed_prompts()[0]["chat_text"]
    markup = tokens_html(tok, chat)
    assert markup.count("tok-special") == chat.count("<|im_start|>") + chat.count("<|im_end|>")
    assert "&lt;|im_start|&gt;" in markup and "<|im_start|>" not in markup
    assert "↵" in markup and "<br>" in markup and "·" in markup
    assert len(chips(markup)) == len(seed_prompts()[0]["input_ids"])


def test_text_is_html_escaped(tok):
    markup = tokens_html(tok, '<script>alert("x")</script> & more')
    assert "<script>" not in markup and "&lt;" in markup and "&amp;" in markup


def test_split_utf8_characters_show_their_bytes(tok):
    pieces = token_pieces(tok, "Hi 🤗")  # after a space the emoji is split into byte tokens
    data = bytes.fromhex("".join(s for p in pieces for s, partial in p.segments if partial))
    assert data == "🤗".encode()
    assert "".join(p.text for p in pieces).startswith("Hi <0xF0>")
    markup = tokens_html(tok, "Hi 🤗")
    assert "tok-partial" in markup and "F0" in markup
    assert [p.text for p in token_pieces(tok, "你好")] == ["你好"]


def test_widget_updates_when_text_changes(tok):
    box = tokenizer_widget(tok, "Hello")
    area, view, count = box.children
    before = view.value
    assert len(chips(before)) == len(tok.encode("Hello", add_special_tokens=False))
    area.value = "Is Stanford a real school?"
    assert view.value != before
    n = len(tok.encode(area.value, add_special_tokens=False))
    assert len(chips(view.value)) == n and f"<b>{n}</b> tokens" in count.value
