// The live tokenizer of chapter 01: Qwen2.5's real vocabulary, run in the browser, no kernel.
//
// The page holds <div id="qwen-tokenizer"></div> and loads this bundle; it fetches
// tokenizer.json and tokenizer_config.json from the bundle's own folder (copied there by
// scripts/build_tokenizer_js.sh), so it works offline. On a page without the placeholder
// it does nothing. Test hook: ?tokenizer-test=<JSON list of texts>[&tokenizer-chat=1]
// runs each text through the widget and writes the results to <pre id="qwen-tokenizer-test">.
import { Tokenizer } from "@huggingface/tokenizers";
import { Template } from "@huggingface/jinja";
import css from "./widget.css";
import { tokenPieces } from "./pieces.js";
import { chipsHtml, piecesText } from "./view.js";

const INITIAL_TEXT = "Type here: Hello, world! ¿Qué tal? 你好 🤗\ndef f(x):\n    return x + 1";
const MAX_CHIPS = 3000; // beyond this the page gets sluggish; ids and count stay complete
// Captured now: document.currentScript is only set while the script first runs.
const ASSETS = new URL(".", document.currentScript?.src || location.href);

const MARKUP = `
  <div class="qtk-head">
    <strong>Qwen2.5 tokenizer, running in your browser</strong>
    <span class="qtk-status" role="status">loading the vocabulary (6 MB)…</span>
  </div>
  <textarea class="qtk-input" rows="4" spellcheck="false" aria-label="Text to tokenize"></textarea>
  <div class="qtk-bar">
    <label><input type="checkbox" class="qtk-chat"> wrap in the chat template</label>
    <span class="qtk-count" aria-live="polite"></span>
  </div>
  <div class="qtk-chips"></div>
  <details open><summary>token ids</summary><pre class="qtk-ids"></pre></details>
  <details><summary>byte pieces (hex where a token holds only part of a character)</summary><pre class="qtk-pieces"></pre></details>`;

async function fetchJson(name) {
  const response = await fetch(new URL(name, ASSETS));
  if (!response.ok) throw new Error(`${name}: HTTP ${response.status}`);
  return response.json();
}

// What transformers' apply_chat_template does for one user message, add_generation_prompt=True.
function chatWrapper(config) {
  const template = new Template(config.chat_template);
  const specials = {};
  for (const key of ["bos_token", "eos_token", "pad_token", "unk_token"]) {
    if (typeof config[key] === "string") specials[key] = config[key];
  }
  return (text) => template.render({ ...specials, messages: [{ role: "user", content: text }], add_generation_prompt: true });
}

function mount(root) {
  root.classList.add("qtk");
  root.innerHTML = MARKUP;
  const $ = (sel) => root.querySelector(sel);
  const ui = { status: $(".qtk-status"), input: $(".qtk-input"), chat: $(".qtk-chat"), count: $(".qtk-count"),
    chips: $(".qtk-chips"), ids: $(".qtk-ids"), pieces: $(".qtk-pieces") };
  ui.input.value = INITIAL_TEXT;
  ui.input.disabled = ui.chat.disabled = true;
  return ui;
}

function showError(ui, error) {
  ui.status.textContent = `could not load the tokenizer: ${error.message || error}`;
  ui.status.classList.add("qtk-error");
}

async function start(root) {
  const ui = mount(root);
  const [tokenizerJson, config] = await Promise.all([fetchJson("tokenizer.json"), fetchJson("tokenizer_config.json")]);
  const tokenizer = new Tokenizer(tokenizerJson, config);
  const addedIds = new Set(tokenizerJson.added_tokens.map((t) => t.id));
  const wrap = chatWrapper(config);

  // Tokenize what is in the box now and redraw everything.
  function update() {
    let text;
    try {
      text = ui.chat.checked ? wrap(ui.input.value) : ui.input.value;
    } catch (error) {
      showError(ui, error);
      return;
    }
    const ids = tokenizer.encode(text, { add_special_tokens: false }).ids;
    const pieces = tokenPieces(tokenizer, ids, addedIds);
    const chars = [...text].length;
    const bytes = new TextEncoder().encode(text).length;
    ui.count.innerHTML = `<b>${ids.length}</b> tokens for <b>${chars}</b> characters (${bytes} UTF-8 bytes)` +
      (ui.chat.checked ? ", chat template included" : "");
    ui.chips.innerHTML = chipsHtml(pieces, MAX_CHIPS);
    ui.ids.textContent = ids.join(", ");
    ui.pieces.textContent = piecesText(pieces);
    ui.shown = { text, ids };
  }

  ui.input.addEventListener("input", update);
  ui.chat.addEventListener("change", update);
  ui.input.disabled = ui.chat.disabled = false;
  ui.status.textContent = `${tokenizer.get_vocab().size.toLocaleString("en")} tokens in the vocabulary; nothing leaves this page`;
  update();
  runTestHook(ui);
}

// For tests/test_book_site.py: type each text into the box, as a reader would, and record
// the ids and count the page shows, and the text it tokenized.
function runTestHook(ui) {
  const params = new URLSearchParams(location.search);
  if (!params.has("tokenizer-test")) return;
  const texts = JSON.parse(params.get("tokenizer-test"));
  ui.chat.checked = params.get("tokenizer-chat") === "1";
  const results = texts.map((typed) => {
    ui.input.value = typed;
    ui.input.dispatchEvent(new Event("input"));
    const ids = ui.ids.textContent ? ui.ids.textContent.split(", ").map(Number) : [];
    return { typed, text: ui.shown.text, count: Number(ui.count.querySelector("b").textContent), ids };
  });
  const out = document.createElement("pre");
  out.id = "qwen-tokenizer-test";
  out.hidden = true;
  out.textContent = JSON.stringify(results);
  document.body.append(out);
}

function init() {
  const root = document.getElementById("qwen-tokenizer");
  if (!root || root.dataset.started) return; // other pages; or the bundle loaded twice
  root.dataset.started = "1";
  const style = document.createElement("style");
  style.textContent = css;
  document.head.append(style);
  start(root).catch((error) => {
    console.error(error);
    showError({ status: root.querySelector(".qtk-status") || root }, error);
  });
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
else init();
