// Token ids -> what they stand for: whole characters where the bytes form them, hex bytes
// where a token holds only part of a UTF-8 character. Mirrors engine_lib/token_view.py.

// Byte-level BPE stores each byte as one printable character: printable Latin-1 bytes
// stand for themselves, the other 68 move, in order, to U+0100 on (' ' -> 'Ġ', '\n' -> 'Ċ').
function byteDecoder() {
  const printable = [];
  for (let b = 0x21; b < 0x7f; b++) printable.push(b);
  for (let b = 0xa1; b < 0xad; b++) printable.push(b);
  for (let b = 0xae; b < 0x100; b++) printable.push(b);
  const keep = new Set(printable);
  const table = new Map(printable.map((b) => [String.fromCharCode(b), b]));
  let moved = 0;
  for (let b = 0; b < 256; b++) if (!keep.has(b)) table.set(String.fromCharCode(0x100 + moved++), b);
  return table;
}

const BYTES = byteDecoder();
const strict = new TextDecoder("utf-8", { fatal: true });

function decodes(bytes) {
  try {
    return strict.decode(bytes);
  } catch {
    return null;
  }
}

// [{text, partial}]: a run of 1-4 bytes that is one character, or one stray byte as 'F0'.
export function utf8Segments(bytes) {
  const out = [];
  let i = 0;
  while (i < bytes.length) {
    let n = 1;
    let text = null;
    for (; n <= 4 && i + n <= bytes.length; n++) {
      text = decodes(bytes.subarray(i, i + n));
      if (text !== null) break;
    }
    if (text !== null) {
      out.push({ text, partial: false });
      i += n;
    } else {
      out.push({ text: bytes[i].toString(16).toUpperCase().padStart(2, "0"), partial: true });
      i += 1;
    }
  }
  return out;
}

// One piece per id: {id, raw, bytes, segments, special}. Added tokens (<|im_start|> ...)
// are whole strings, not bytes, and are shown as special like in the Python rendering.
export function tokenPieces(tokenizer, ids, addedIds) {
  return ids.map((id) => {
    const raw = tokenizer.id_to_token(id) ?? "";
    if (addedIds.has(id)) return { id, raw, bytes: null, segments: [{ text: raw, partial: false }], special: true };
    const bytes = Uint8Array.from(raw, (ch) => BYTES.get(ch) ?? 0x3f);
    return { id, raw, bytes, segments: utf8Segments(bytes), special: false };
  });
}
