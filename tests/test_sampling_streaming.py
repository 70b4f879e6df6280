from engine_lib.model.tokenizer import load_tokenizer
from engine_lib.sampling.streaming import REPLACEMENT, IncrementalDecoder


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


def test_the_rust_tokenizer_path_gives_the_wrapper_s_text():
    """The decoder calls the Rust tokenizer itself (a server decodes twice per token and row); on any
    ids, special ones included, it must give what ``tokenizer.decode`` gives."""
    import random

    tok = load_tokenizer()
    fast, slow = IncrementalDecoder(tok), IncrementalDecoder(tok)
    slow.backend = None  # the transformers wrapper
    assert fast.backend is not None
    rng = random.Random(0)
    ids = tok("Hello 世界! 🙂 naïve")["input_ids"] + [rng.randrange(len(tok)) for _ in range(300)]
    ids[5:5] = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")]
    assert [fast.push(i) for i in ids] + [fast.flush()] == [slow.push(i) for i in ids] + [slow.flush()]


def test_a_stream_left_early_gives_its_blocks_back(engines, prompts):
    """``Engine.stream`` runs the token loop in the caller's thread: a caller that stops reading (closes the
    generator) cancels its sequence, so every block of the loop's cache is free again and the next call
    makes the same tokens as before."""
    engine = engines("kv_cache")
    opts = dict(max_new_tokens=40, do_sample=False, stop_token_ids=[])
    before = engine.generate(prompts[0], **opts)
    allocator = engine.loop.core.scheduler.cache.allocator
    free = allocator.num_free
    pieces = engine.stream(prompts[0], **opts)
    for _ in range(3):
        next(pieces)
    assert allocator.num_free < free  # the sequence holds its blocks while it runs
    pieces.close()
    assert engine.loop.core.scheduler.cache.allocator is allocator and allocator.num_free == free
    assert not engine.loop.core.scheduler.active and not engine.loop.core.scheduler.waiting
    assert engine.generate(prompts[0], **opts).token_ids == before.token_ids
