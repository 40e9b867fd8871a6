import pytest

from lib import data


def test_loaders_return_rows():
    assert len(data.challenge_prompts()) == 1199 and len(data.challenge_prompts(5)) == 5
    w = data.wiki_samples(3)
    assert set(w[0]) == {"prompt", "gold"}
    d = data.davidson_tweets()
    assert set(d.toxic.unique()) == {0, 1} and (d.toxic == 1).sum() == (d.toxic == 0).sum()
    for task in data.GLUE_TASKS:
        df = data.glue(task, "dev")
        assert set(df.label.unique()) <= {0, 1} and len(df) > 200
    assert len(data.lre_relation("country_capital_city")["samples"]) == 24
    k = data.klar("eng_Latn")
    assert len(k) == 1197 and k.relation.iloc[0] == "capital_of" and k.answer.iloc[1] == "Turkey"


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="SST-2"):
        data.glue("QQP")
    with pytest.raises(ValueError, match="dev"):
        data.glue("RTE", "test")
    with pytest.raises(ValueError, match="country_capital_city"):
        data.lre_relation("capital")
    with pytest.raises(ValueError, match="eng_Latn"):
        data.klar("xx")
    with pytest.raises(ValueError, match="positive"):
        data.challenge_prompts(0)


def test_missing_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "DATA", tmp_path)
    with pytest.raises(FileNotFoundError, match="make_data.py"):
        data.challenge_prompts()


def test_a_users_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    """A Latin-1 byte in a user's JSONL file (facts or prompts): one line naming the file, the line and the byte,
    not a UnicodeDecodeError with an offset into the whole file."""
    f = tmp_path / "mine.jsonl"
    f.write_bytes(b'{"text": "ok"}\r\n\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(ValueError) as e:
        data.user_jsonl(f, "prompts", "Your own prompts")
    assert str(e.value) == ("mine.jsonl line 3: not UTF-8 text (byte 0xe9 at byte 14 of the line); "
                            "save the file as UTF-8")
    f.write_bytes('{"text": "café"}\n'.encode("utf-8"))
    assert data.user_jsonl(f, "prompts", "Your own prompts") == [(1, {"text": "café"})]
