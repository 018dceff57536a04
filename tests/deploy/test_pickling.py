"""What a Ray Serve replica receives must pickle, whatever the tests did with it before."""
from __future__ import annotations


def test_a_tokenizer_that_rendered_a_chat_still_pickles_for_a_replica(smol_tokenizer):
    import pickle

    msgs = [{"role": "user", "content": "hi"}]
    text = smol_tokenizer.render_chat(msgs)             # compiles and caches the jinja template
    copy = pickle.loads(pickle.dumps(smol_tokenizer))
    assert copy.render_chat(msgs) == text and copy.encode(text) == smol_tokenizer.encode(text)
