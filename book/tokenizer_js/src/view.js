// HTML for the pieces: coloured chips, the ids, and the byte pieces.

// The pastel cycle of engine_lib/token_view.py, so the web page and the notebook look alike.
const PALETTE = ["#fde2a7", "#c9e7f5", "#d5f0c8", "#f7cfe0", "#e2d9f7", "#fbd5bd"];
const MARKS = { " ": "·", "\n": "↵", "\t": "→", "\r": "␍" };

export function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function chip(piece, position) {
  const tip = escapeHtml(`id ${piece.id} | position ${position} | ${JSON.stringify(piece.raw)}`);
  const id = `<sub class="qtk-id">${piece.id}</sub>`;
  if (piece.special) return `<span class="qtk-chip qtk-special" title="${tip}">${escapeHtml(piece.raw)}${id}</span>`;
  let cls = "qtk-chip";
  let body = "";
  let newline = false;
  for (const seg of piece.segments) {
    if (seg.partial) {
      cls = "qtk-chip qtk-partial";
      body += `<span class="qtk-byte">${seg.text}</span>`;
      continue;
    }
    for (const ch of seg.text) {
      newline ||= ch === "\n";
      body += MARKS[ch] ? `<span class="qtk-mark">${MARKS[ch]}</span>` : escapeHtml(ch);
    }
  }
  const style = `background:${PALETTE[position % PALETTE.length]}`;
  // A newline token ends its line, as the text does.
  return `<span class="${cls}" style="${style}" title="${tip}">${body}${id}</span>${newline ? "<br>" : ""}`;
}

export function chipsHtml(pieces, limit) {
  const shown = pieces.slice(0, limit).map(chip).join("");
  const more = pieces.length > limit ? `<span class="qtk-more">… ${pieces.length - limit} more tokens</span>` : "";
  return shown + more;
}

// One line per token: its id and its text as a JSON string; a byte that is only part of a
// UTF-8 character shows as <0xF0>, like TokenPiece.text in engine_lib/token_view.py.
export function piecesText(pieces) {
  return pieces
    .map((p) => {
      const text = p.segments.map((s) => (s.partial ? `<0x${s.text}>` : s.text)).join("");
      return `${String(p.id).padStart(6)}  ${JSON.stringify(text)}`;
    })
    .join("\n");
}
