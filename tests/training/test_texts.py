"""Teacher-forced text records from reStructuredText documentation: sections and documented objects become
chat answers with the markup gone, in a seeded order up to a token budget; eagle.py never validates on them and
keeps them out of the draft vocabulary."""
from __future__ import annotations

import json
from argparse import Namespace

import pytest

from nightjar.models.eagle import HeadConfig
from nightjar.training.eagle import answer_counts, model_card, split_rows
from nightjar.training.texts import append_records, main, section_labels, text_records, units
from tests.conftest import tiny_config

RST = """\
.. _tut-json:

**************************
:mod:`json` --- JSON tools
**************************

.. module:: json
   :synopsis: Encode and decode JSON.

.. index::
   single: JSON

The :mod:`json` module reads and writes JSON, see :pep:`8` and the
:ref:`conversion table <py-to-json>`.  Use ``json.dumps`` like this::

   >>> json.dumps([1, 2])
   '[1, 2]'

.. a comment that
   spans two lines

.. function:: dumps(obj, *, indent=None, \\
                    sort_keys=False)
              dump(obj, fp)
   :noindex:

   Serialize *obj* to a :class:`str`.

   +-------+------+
   | a     | b    |
   +-------+------+

   .. versionchanged:: 3.6

      *sort_keys* is kept.
   .. versionadded:: 3.2

   * A list item with a literal block::

        x = a|b

.. class:: JSONDecoder()

   .. method:: decode(s)

      Decode *s*; see :ref:`decoding` and :ref:`tut-json`.

      .. note::
         Say ``re.compile('a|b')`` in
         one ``line``.

.. _decoding:

Decoding
========

Read JSON with :func:`~json.loads`.
"""


def test_sections_and_objects_lose_their_markup_and_keep_code_fenced():
    labels = section_labels(RST)
    assert labels == {"tut-json": "`json` - JSON tools", "decoding": "Decoding"}
    got = units(RST, "library/json.rst.txt", labels)
    assert [(u["kind"], u["title"]) for u in got] == [
        ("section", "`json` - JSON tools"),
        ("object", "json.dumps(obj, *, indent=None, sort_keys=False)"),          # the second signature dropped
        ("object", "json.JSONDecoder.decode(s)"),            # a method named with its class; the class has no text
        ("section", "Decoding")]
    intro, dumps, decode, decoding = (u["body"] for u in got)
    assert intro == ("The `json` module reads and writes JSON, see PEP 8 and the conversion table.  Use `json.dumps` "
                     "like this:\n\n```\n>>> json.dumps([1, 2])\n'[1, 2]'\n```")     # one line per paragraph
    assert dumps == ("Serialize *obj* to a `str`.\n\n| a     | b    |\n\nChanged in version 3.6:\n*sort_keys* is "
                     "kept.\n\nNew in version 3.2.\n\n* A list item with a literal block:\n\n```\nx = a|b\n```")
    assert decode == ("Decode *s*; see Decoding and `json` - JSON tools.\n\nNote:\nSay `re.compile('a|b')` in one "
                      "`line`.")
    assert decoding == "Read JSON with `loads`."
    assert all(u["source"] == "library/json.rst.txt" for u in got)


def test_markup_is_cleaned_outside_code_only():
    text = ("Use :func:`f` and ``x``\nor `PEP <https://p>`_.\n\n.. code-block:: python\n\n   a = ``b`` | c |\n\n"
            ".. only:: html\n\n   Shown.\n")
    (unit,) = units("Title\n=====\n\n" + text, "x")
    assert unit["body"] == "Use `f` and `x` or PEP.\n\n```\na = ``b`` | c |\n```\n\nShown."


def test_records_are_chat_answers_cut_to_length_in_a_seeded_order_up_to_the_budget(tmp_path, smol_tokenizer):
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "json.rst.txt").write_text(RST)
    (tmp_path / "whatsnew").mkdir()
    (tmp_path / "whatsnew" / "3.11.rst.txt").write_text("Changes\n=======\n\n" + "Many changes. " * 40 + "\n")
    recs = text_records(tmp_path, smol_tokenizer, tokens=10_000, seed=0, max_answer=12, min_answer=5)
    assert len(recs) == len(units(RST, "x")) == 4           # every unit but what's new; each at least 5 tokens
    assert all(r["variant"] == "text" and r["id"].startswith("doc-") for r in recs)
    assert {r["id"] for r in recs} == {r["id"] for r in text_records(tmp_path, smol_tokenizer, 10_000, seed=1,
                                                                      max_answer=20, min_answer=5)}  # stable ids
    bodies = [smol_tokenizer.encode(u["body"]) for u in units(RST, "x", section_labels(RST))]
    assert sorted(r["answer_ids"] for r in recs) == sorted(b[:12] for b in bodies)      # each body, cut at 12
    chat_end = smol_tokenizer.encode_chat([{"role": "user", "content": "x"}])[-3:]     # the assistant's turn opens
    assert all(r["prompt_ids"][-3:] == chat_end for r in recs)
    assert text_records(tmp_path, smol_tokenizer, tokens=10_000, seed=0, max_answer=12, min_answer=5) == recs
    first = text_records(tmp_path, smol_tokenizer, tokens=13, seed=0, max_answer=12, min_answer=5)
    assert first == recs[: len(first)]                                   # the same order, stopped at the budget
    assert sum(len(r["answer_ids"]) for r in first[:-1]) < 13 <= sum(len(r["answer_ids"]) for r in first)
    assert text_records(tmp_path, smol_tokenizer, tokens=10_000, seed=0, max_answer=12, min_answer=13) == []


def test_text_records_always_train_and_stay_out_of_the_draft_vocabulary():
    answers = [{"id": f"qa-{i:02d}", "variant": "greedy", "prompt_ids": [1], "answer_ids": [5, 6]} for i in range(40)]
    texts = [{"id": f"doc-{i:06d}", "variant": "text", "prompt_ids": [1], "answer_ids": [7, 7, 7]} for i in range(40)]
    records = answers[:20] + texts + answers[20:]
    train, val = split_rows(records)
    assert [records[i]["id"] for i in val] == ["qa-00", "qa-20"]          # every 20th answer id, no text
    assert sorted(train + val) == list(range(80))
    counts = answer_counts(records, train, 10)
    assert counts[7] == 0 and counts[5] == counts[6] == 38


def test_the_cli_rejects_a_missing_source_a_bad_size_and_a_directory_as_corpus_with_exit_2(tmp_path, capsys):
    for argv in (["--rst", str(tmp_path / "none"), "--out", str(tmp_path / "t.jsonl")],
                 ["--rst", str(tmp_path), "--out", str(tmp_path / "t.jsonl"), "--tokens", "0"],
                 ["--rst", str(tmp_path), "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].count("error:") == 1
    assert not (tmp_path / "t.jsonl").exists()


def test_appending_skips_records_the_corpus_holds_and_leaves_an_unfinished_line_alone(tmp_path):
    path = tmp_path / "answers.jsonl"
    answer = {"id": "qa-01", "variant": "greedy", "prompt_ids": [1], "answer_ids": [2]}
    texts = [{"id": f"doc-{i:06d}", "variant": "text", "prompt_ids": [1], "answer_ids": [3 + i]} for i in range(3)]
    unfinished = json.dumps(answer) + "\n\n" + json.dumps(texts[0]) + "\n" + json.dumps(texts[1])[:10]
    path.write_text(unfinished)
    with pytest.raises(ValueError, match="unfinished"):
        append_records(path, texts)
    assert path.read_text() == unfinished                                  # left for its writer to finish
    path.write_text(unfinished[: unfinished.rindex("\n") + 1])
    assert append_records(path, texts) == 2
    assert [json.loads(x) for x in path.read_text().splitlines() if x] == [answer] + texts
    assert append_records(path, texts) == 0 and path.read_text().count("\n") == 5


def test_the_model_card_counts_answers_and_text_records_apart():
    hc = HeadConfig.for_target(tiny_config(vocab=100, hidden=32, layers=4), 64)
    info = {"lines": 30, "records": 30, "text_records": 10, "train_records": 28, "val_records": 2, "tokens": 900,
            "answer_tokens": 400, "text_tokens": 300, "prompts": 20, "fill": {"tokens": 900, "seconds": 60.0},
            "captured": 0, "coverage": {64: {"answer_tokens": 1.0, "val_answer_tokens": 0.9, "argmax": 0.95}}}
    state = {"final_val": None, "losses": [1.0], "step": 5, "epoch": 1, "elapsed": 60.0, "best_step": 5}
    a = Namespace(corpus="c.jsonl", ttt=4, drop_oov=False, batch=8, lr=8e-4, minutes=1.0, vocab=64, seed=0,
                  max_len=512, max_steps=None, intermediate=None)
    card = " ".join(model_card(hc, info, state, a).split())
    assert ("Data: 20 answers of the target to 20 training prompts (c.jsonl) and 10 teacher-forced text records "
            "(`training/texts.py`: the Python documentation as answers, 300 answer tokens, training only") in card
    assert "400 answer tokens; 28 records train, 2 answers validate" in card
    assert "teacher-forced" not in " ".join(model_card(hc, {**info, "text_records": 0}, state, a).split())
