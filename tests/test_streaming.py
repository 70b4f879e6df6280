from engine_lib.streaming import REPLACEMENT, IncrementalDecoder
from engine_lib.tokenizer import load_tokenizer


def test_multibyte_utf8_is_never_split():
    tok = load_tokenizer()
    text = "Hello 世界! Emoji: 🙂🚀 naïve café — Ελληνικά 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = tok(text)["input_ids"]
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # some tokens are partial characters
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_engine_stream_equals_generate(engines, prompts):
    engine = engines("kv_cache")
    full = engine.generate(prompts[0], max_new_tokens=20, do_sample=False)
    assert "".join(engine.stream(prompts[0], max_new_tokens=20, do_sample=False)) == full.text
