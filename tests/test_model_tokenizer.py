from engine_lib.model.tokenizer import chat_ids, load_tokenizer, seed_prompts


def test_seed_prompts_tokenize_to_reference_ids():
    tok = load_tokenizer()
    prompts = seed_prompts()
    assert len(prompts) == 10
    for p in prompts:
        assert chat_ids(tok, [{"role": "user", "content": p["prompt"]}]) == p["input_ids"], p["prompt"]
        assert tok.decode(p["input_ids"]) == p["chat_text"]


def test_stop_tokens_and_fallback_to_vendored(tmp_path):
    tok = load_tokenizer(tmp_path)  # no tokenizer files there: the vendored one is used
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) == [151645, 151643]
