"""See what the tokenizer does: each token as a coloured chip, and a live widget.

Defined in chapter 01 (tokens). ``tokens_html`` returns plain HTML with inline styles, so
it renders in Jupyter, Colab and the static book without a kernel; ``tokenizer_widget``
wraps it in an ipywidgets box that re-tokenizes as you type (ipywidgets 7 and 8).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from functools import lru_cache

# Pastel backgrounds, cycled by token position so that neighbours always differ.
PALETTE = ("#fde2a7", "#c9e7f5", "#d5f0c8", "#f7cfe0", "#e2d9f7", "#fbd5bd")
CHIP_STYLE = ("display:inline-block;border-radius:4px;padding:1px 3px;margin:2px 1px;"
              "font-family:ui-monospace,Menlo,Consolas,monospace;font-size:0.9em;color:#111;"
              "white-space:pre;line-height:1.5")
SPECIAL_STYLE = "background:#37474f;color:#fff;font-weight:600"
MARK_STYLE = "color:#8a6d3b"  # visible whitespace markers
BYTE_STYLE = "color:#b00020;font-size:0.85em;border:1px dashed #b00020;border-radius:2px;padding:0 1px"
ID_STYLE = "font-size:0.65em;color:#555;margin-left:2px"
SPECIAL_ID_STYLE = "font-size:0.65em;color:#cfd8dc;margin-left:2px"
WHITESPACE_MARKS = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Byte-level BPE stores each byte as one printable character; this maps it back.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
    ...) are moved, in order, to the characters from U+0100 on: ' ' becomes 'Ġ', '\\n' 'Ċ'.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(moved)})
    return table


@dataclass
class TokenPiece:
    id: int
    raw: str  # the vocabulary entry, e.g. 'ĠHello'
    segments: list[tuple[str, bool]]  # (text, is_partial_byte): decoded text, or 'F0'-style hex for stray bytes
    special: bool

    @property
    def text(self) -> str:
        return "".join(f"<0x{s}>" if partial else s for s, partial in self.segments)


def _utf8_segments(data: bytes) -> list[tuple[str, bool]]:
    """Whole characters where the bytes form them; each leftover byte of a split character as hex."""
    out, i = [], 0
    while i < len(data):
        for n in (1, 2, 3, 4):
            try:
                out.append((data[i:i + n].decode("utf-8"), False))
                i += n
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append((f"{data[i]:02X}", True))
            i += 1
    return out


def token_pieces(tokenizer, text_or_ids) -> list[TokenPiece]:
    """Tokenize a string (special-token text such as <|im_start|> is recognised) or take ids."""
    ids = tokenizer.encode(text_or_ids, add_special_tokens=False) if isinstance(text_or_ids, str) \
        else [int(i) for i in text_or_ids]
    added = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
    decode = byte_decoder()
    pieces = []
    for tid, raw in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        if tid in added:
            pieces.append(TokenPiece(tid, raw, [(raw, False)], True))
        else:
            data = bytes(decode[c] for c in raw)
            pieces.append(TokenPiece(tid, raw, _utf8_segments(data), False))
    return pieces


def _chip(piece: TokenPiece, position: int, show_ids: bool) -> str:
    if piece.special:
        style, cls, body = SPECIAL_STYLE, "tok-chip tok-special", html.escape(piece.raw)
    else:
        style, cls, parts = f"background:{PALETTE[position % len(PALETTE)]}", "tok-chip", []
        for seg, partial in piece.segments:
            if partial:
                cls = "tok-chip tok-partial"
                parts.append(f'<span class="tok-byte" style="{BYTE_STYLE}">{seg}</span>')
            else:
                for ch in seg:
                    mark = WHITESPACE_MARKS.get(ch)
                    parts.append(f'<span style="{MARK_STYLE}">{mark}</span>' if mark else html.escape(ch))
        body = "".join(parts)
    tip = html.escape(f"id {piece.id} | position {position} | {piece.raw!r}", quote=True)
    id_style = SPECIAL_ID_STYLE if piece.special else ID_STYLE
    sub = f'<sub class="tok-id" style="{id_style}">{piece.id}</sub>' if show_ids else ""
    tail = "<br>" if not piece.special and "\n" in piece.text else ""
    return f'<span class="{cls}" title="{tip}" style="{CHIP_STYLE};{style}">{body}{sub}</span>{tail}'


def tokens_html(tokenizer, text_or_ids, show_ids: bool = True) -> str:
    """One coloured chip per token; hover for id and position, ids also as subscripts.

    Spaces show as ·, newlines as ↵ (and break the line), special tokens are dark, and a
    byte of a character split across tokens shows as its hex value in a dashed box.
    """
    pieces = token_pieces(tokenizer, text_or_ids)
    chips = "".join(_chip(p, i, show_ids) for i, p in enumerate(pieces))
    return f'<div class="tok-view" style="line-height:2.2;max-width:100%">{chips}</div>'


def tokenizer_widget(tokenizer, initial_text: str = "Type anything: Hello, world! 你好 🤗"):
    """A Textarea, the chips of its tokens and a token count, updated as you type."""
    import ipywidgets as widgets

    box = widgets.Textarea(value=initial_text, placeholder="Type here", continuous_update=True,
                           layout=widgets.Layout(width="100%", height="6em"))
    view, count = widgets.HTML(), widgets.HTML()

    def update(change=None) -> None:
        ids = tokenizer.encode(box.value, add_special_tokens=False)
        view.value = tokens_html(tokenizer, ids)
        count.value = (f'<span class="tok-count"><b>{len(ids)}</b> tokens for <b>{len(box.value)}</b> '
                       f"characters ({len(box.value.encode('utf-8'))} UTF-8 bytes)</span>")

    box.observe(update, names="value")
    update()
    return widgets.VBox([box, view, count])
