"""actors.datasets on small invented fixtures (tests/fixtures/datasets), good and broken."""
import gzip
import json
import shutil
from pathlib import Path

import pytest

from sonar.actors.datasets import DatasetError, QAItem, load_dataset, load_datasets

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "datasets"

# (file, fmt to pass, expected source, count, first qid, first golds)
GOOD = [
    ("flashrag_train.jsonl", "auto", "flashrag_train", 6, "train_0", ["Sarn River", "the Sarn"]),
    ("flashrag_train.jsonl", "search_r1", "flashrag_train", 6, "train_0", ["Sarn River", "the Sarn"]),
    ("flashrag/hotpotqa/dev.jsonl", "auto", "hotpotqa", 5, "dev_0", ["Mira Coss"]),
    ("hotpot_dev_distractor.json", "auto", "hotpotqa", 5, "h0001", ["Tin Lantern"]),
    ("2wiki_dev.json", "auto", "2wiki", 5, "w01", ["Ena Hask"]),
    ("2wikimultihop_min.json", "auto", "2wiki", 3, "w01", ["Ena Hask"]),
    ("2wikimultihop_min.json", "hotpotqa", "hotpotqa", 3, "w01", ["Ena Hask"]),
    ("musique_ans_dev.jsonl", "auto", "musique", 5, "2hop__101_202", ["Oskan", "the Oskan language", "Oskani"]),
    ("bamboogle.csv", "auto", "bamboogle", 5, "bamboogle-0", ["Odile Marr"]),
    ("bamboogle_test.json", "auto", "bamboogle", 5, "bamboogle-0", ["Odile Marr"]),
    ("bamboogle_test.jsonl", "auto", "bamboogle", 5, "bamboogle-0", ["Odile Marr"]),
    # R1-Searcher's own files ({idx, question, answer}), detected from the content whatever the name
    ("r1_searcher/eval_set/hotpotqa_500.jsonl", "auto", "hotpotqa_500", 3, "hotpotqa_500-1", ["Tin Lantern"]),
    ("r1_searcher/eval_set/2wiki_500.jsonl", "auto", "2wiki_500", 2, "2wiki_500-1", ["Orla Hask"]),
    ("r1_searcher/eval_set/musique_500.jsonl", "auto", "musique_500", 2, "musique_500-1",
     ["Brass Lantern Award for Best Short Film"]),
    ("r1_searcher/eval_set/bamboogle.jsonl", "auto", "bamboogle", 3, "bamboogle-1", ["odile marr"]),
    ("r1_searcher/training_set/stage_1.jsonl", "auto", "stage_1", 2, "stage_1-37653", ["Velmora Route 9"]),
    ("r1_searcher/training_set/stage_2.jsonl", "auto", "stage_2", 3, "stage_2-1", ["filmmaker"]),
    ("r1_searcher/training_set/stage_2.jsonl", "r1_searcher", "stage_2", 3, "stage_2-1", ["filmmaker"]),
    # RAG-R1's RL JSON ({question, golden_answers: one string}): FlashRAG's fields, source = its folder
    ("rag_r1/hotpotqa_train_filter/test_data.json", "auto", "hotpotqa_train_filter", 3, "hotpotqa_train_filter-0",
     ["March 24, 2005"]),
    ("rag_r1/hotpotqa_train_filter/test_data.json", "rag_r1", "hotpotqa_train_filter", 3, "hotpotqa_train_filter-0",
     ["March 24, 2005"]),
    # the "your own data" example (HotpotQA JSON with supporting facts and context)
    ("../../../examples/own_data/hotpot_mini.json", "auto", "hotpotqa", 8, "hm01", ["Ada Pell"]),
]


@pytest.mark.parametrize("name,fmt,source,count,qid,golds", GOOD, ids=[f"{g[0]}-{g[1]}" for g in GOOD])
def test_load_good(name, fmt, source, count, qid, golds):
    items = load_dataset(FIX / name, fmt=fmt)
    assert len(items) == count
    assert all(isinstance(i, QAItem) and i.source == source and i.question and i.golds for i in items)
    assert items[0].qid == qid and items[0].golds == golds
    assert len({i.qid for i in items}) == count


def test_flashrag_details():
    items = load_dataset(FIX / "flashrag_train.jsonl")
    assert items[3].qid == "flashrag_train-3"           # no id -> <source>-<index>
    assert items[3].golds == ["teal"]                    # a single string gold
    assert items[0].meta == {"metadata.hops": 1, "metadata.note": "fixture"}
    assert items[4].meta == {"metadata.type": "comparison"}  # large metadata fields dropped


def test_hotpot_and_musique_meta():
    hot = load_dataset(FIX / "hotpot_dev_distractor.json")
    assert hot[0].meta == {"type": "comparison", "level": "easy"}   # context/supporting_facts dropped
    assert hot[4].golds == ["3"]                                     # numeric answer kept as text
    mus = load_dataset(FIX / "musique_ans_dev.jsonl")
    assert mus[2].golds == ["1912", "in 1912"]                       # aliases de-duplicated
    assert mus[3].meta == {"answerable": False}
    assert "paragraphs" not in mus[0].meta


def test_source_override_and_gzip(tmp_path):
    gz = tmp_path / "musique_ans_dev.jsonl.gz"
    with open(FIX / "musique_ans_dev.jsonl", "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    items = load_dataset(gz, source="mq")
    assert len(items) == 5 and items[0].source == "mq"


def test_jsonl_named_json(tmp_path):
    p = tmp_path / "nq_dev.json"
    shutil.copy(FIX / "flashrag_train.jsonl", p)
    assert len(load_dataset(p)) == 6


# (file, fmt, substrings the error message must contain: file, location, field)
BAD = [
    ("bad_missing_field.jsonl", "auto", ["bad_missing_field.jsonl", "line 3", "'golden_answers'", "missing"]),
    ("bad_json.jsonl", "auto", ["bad_json.jsonl", "line 2", "invalid JSON"]),
    ("bad_answer_type.jsonl", "auto", ["bad_answer_type.jsonl", "line 2", "'golden_answers[0]'", "got dict"]),
    ("bad_duplicate_id.jsonl", "auto", ["line 3", "'id'", "duplicate id 'a'", "first at line 1"]),
    ("bad_empty_question.jsonl", "auto", ["line 1", "'question'", "empty"]),
    ("bad_hotpot.json", "auto", ["bad_hotpot.json", "record 2", "'question'", "missing"]),
    ("bad_hotpot_answer_list.json", "auto", ["record 1", "'answer'", "got list"]),
    ("bad_musique_aliases.jsonl", "auto", ["line 2", "'answer_aliases'", "got dict"]),
    ("bad_bamboogle.csv", "auto", ["bad_bamboogle.csv", "line 4", "'Answer'", "empty"]),
    ("bad_bamboogle_columns.csv", "auto", ["line 2", "'Question'", "missing"]),
    ("unknown_format.jsonl", "auto", ["unknown_format.jsonl", "cannot detect the format", "['query', 'target']",
                                      "--format", "stages.N.format", "fmt="]),
    ("flashrag_train.jsonl", "musique", ["line 1", "'answer'", "missing"]),
    ("flashrag_train.jsonl", "squad", ["format 'squad'", "r1_searcher", "verl"]),
    ("does_not_exist.jsonl", "auto", ["does_not_exist.jsonl", "no such file"]),
]


@pytest.mark.parametrize("name,fmt,parts", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_load_errors(name, fmt, parts):
    with pytest.raises(DatasetError) as e:
        load_dataset(FIX / name, fmt=fmt)
    for p in parts:
        assert p in str(e.value), (p, str(e.value))


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(DatasetError, match="no records"):
        load_dataset(p)


def test_dataset_error_is_value_error():
    assert issubclass(DatasetError, ValueError)


# ---------------------------------------------------------------- upstream layouts, gold text, parquet
def test_r1_searcher_files_keep_gold_text_and_drop_generations():
    """Golds are the file's text (R1-Searcher's Bamboogle has 'james madison' lowercased upstream and
    'Titan IIIE' not): nothing is lowercased; generated text (gen_text_store, pred_anses) is not kept."""
    bam = load_dataset(FIX / "r1_searcher/eval_set/bamboogle.jsonl")
    assert [i.golds for i in bam] == [["odile marr"], ["Titan IIIE-Q"], ["Yes"]]
    hot = load_dataset(FIX / "r1_searcher/eval_set/hotpotqa_500.jsonl")
    assert hot[2].golds == ["1,000"] and hot[0].meta == {}
    st1 = load_dataset(FIX / "r1_searcher/training_set/stage_1.jsonl")
    assert [i.qid for i in st1] == ["stage_1-37653", "stage_1-37664"] and st1[1].meta == {}


def test_gold_text_is_kept_in_every_format(tmp_path):
    """Case, inner punctuation and inner spaces survive loading in every format (only the ends are stripped)."""
    gold = "  Saint-Denis,  Réunion (FR)  "
    kept = "Saint-Denis,  Réunion (FR)"
    files = {
        "a.jsonl": ('{"id": "x", "question": "q?", "golden_answers": [%s]}' % json.dumps(gold), "flashrag"),
        "hotpot.json": (json.dumps([{"_id": "x", "question": "q?", "answer": gold, "level": "easy"}]), "hotpotqa"),
        "m.jsonl": (json.dumps({"id": "x", "question": "q?", "answer": gold, "answer_aliases": [gold.upper()]}),
                    "musique"),
        "b.csv": ('Question,Answer\nq?,"%s"\n' % gold, "bamboogle"),
        "r.jsonl": (json.dumps({"idx": 1, "question": "q?", "answer": gold}), "r1_searcher"),
    }
    for name, (text, fmt) in files.items():
        (tmp_path / name).write_text(text)
        items = load_dataset(tmp_path / name)
        assert items[0].golds[0] == kept, (name, fmt, items[0].golds)
        assert load_dataset(tmp_path / name, fmt=fmt) == items  # auto detected this format
    assert load_dataset(tmp_path / "m.jsonl")[0].golds == [kept, kept.upper()]


def test_r1_searcher_without_idx_needs_the_format(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"question": "q?", "answer": "A"}) + "\n" + json.dumps({"question": "r?", "answer": "B"}))
    with pytest.raises(DatasetError, match="cannot detect the format"):
        load_dataset(p)
    items = load_dataset(p, fmt="r1_searcher")
    assert [i.qid for i in items] == ["qa-0", "qa-1"] and items[1].golds == ["B"]


def test_r1_searcher_errors_name_file_line_field(tmp_path):
    p = tmp_path / "hotpotqa_500.jsonl"
    p.write_text(json.dumps({"idx": 1, "question": "q?", "answer": "A"}) + "\n"
                 + json.dumps({"idx": 2, "question": "r?", "answer": ""}) + "\n")
    with pytest.raises(DatasetError) as e:
        load_dataset(p)
    assert all(x in str(e.value) for x in ("hotpotqa_500.jsonl", "line 2", "'answer[0]'", "empty")), str(e.value)
    p.write_text(json.dumps({"idx": 1, "question": "q?", "answer": "A"}) + "\n"
                 + json.dumps({"idx": 1, "question": "r?", "answer": "B"}) + "\n")
    with pytest.raises(DatasetError) as e:
        load_dataset(p)
    assert all(x in str(e.value) for x in ("line 2", "'idx'", "duplicate", "first at line 1")), str(e.value)


SEARCH_R1_PREFIX = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every "
                    "time you get new information. ... For example, <answer> Beijing </answer>. Question: {question}\n")


def _verl_rows(records, data_source, keep_columns):
    """Rows as Search-R1's nq_search.py / RAG-R1's hotpotqa_search.py write them (datasets.map keeps the
    source columns unless they are removed; keep_columns=False mirrors a file written without them)."""
    rows = []
    for idx, ex in enumerate(records):
        q = ex["question"].strip()
        q = q if q.endswith("?") else q + "?"
        row = {"data_source": data_source,
               "prompt": [{"role": "user", "content": SEARCH_R1_PREFIX.format(question=q)}],
               "ability": "fact-reasoning",
               "reward_model": {"style": "rule", "ground_truth": {"target": ex["golden_answers"]}},
               "extra_info": {"split": "train", "index": idx}}
        if keep_columns:
            row = {**ex, "question": q, **row}
        rows.append(row)
    return rows


def _write_parquet(rows, path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_search_r1_parquet(tmp_path):
    """Search-R1's merged train.parquet: nq and hotpotqa rows whose FlashRAG ids repeat; qid is
    <data_source>-<extra_info.index>, source the row's data_source, golds the reward's target."""
    nq = [{"id": "train_0", "question": "who wrote the invented song kettle", "golden_answers": ["Ada Pell", "A. Pell"]},
          {"id": "train_1", "question": "when did the made-up brim arch open?", "golden_answers": ["1921"]}]
    hp = [{"id": "train_0", "question": "Which band released Glass Orchard?", "golden_answers": ["Tin Lantern"]}]
    path = _write_parquet(_verl_rows(nq, "nq", True) + _verl_rows(hp, "hotpotqa", True), tmp_path / "train.parquet")
    items = load_dataset(path)
    assert [i.qid for i in items] == ["nq-0", "nq-1", "hotpotqa-0"]
    assert [i.source for i in items] == ["nq", "nq", "hotpotqa"]
    assert items[0].question == "who wrote the invented song kettle?"  # as Search-R1 stored it (with '?')
    assert items[0].golds == ["Ada Pell", "A. Pell"] and items[2].golds == ["Tin Lantern"]
    assert items[0].meta["ability"] == "fact-reasoning" and items[0].meta["extra_info.split"] == "train"
    assert load_dataset(path, fmt="search_r1_parquet") == items


def test_rag_r1_parquet_question_from_the_prompt(tmp_path):
    """RAG-R1's hotpotqa_search.py target is one string; without a question column the question is
    taken from the prompt, after its last 'Question:'."""
    recs = [{"question": "What date did the invented series Brass Harbor first air", "golden_answers": "March 24, 2005"},
            {"question": "Is Question: a tricky word?", "golden_answers": "yes"}]
    path = _write_parquet(_verl_rows(recs, "hotpotqa_train_filter", False), tmp_path / "test.parquet")
    items = load_dataset(path)
    assert [i.question for i in items] == ["What date did the invented series Brass Harbor first air?",
                                           "a tricky word?"]
    assert [i.golds for i in items] == [["March 24, 2005"], ["yes"]]
    assert [i.qid for i in items] == ["hotpotqa_train_filter-0", "hotpotqa_train_filter-1"]


def test_parquet_errors_name_file_row_field(tmp_path):
    rows = _verl_rows([{"question": "q one", "golden_answers": ["A"]}, {"question": "q two", "golden_answers": ["B"]}],
                      "nq", False)
    rows[1]["prompt"] = [{"role": "user", "content": "no marker here"}]
    path = _write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(DatasetError) as e:
        load_dataset(path)
    assert all(x in str(e.value) for x in ("bad.parquet", "row 1", "'prompt'", "Question:")), str(e.value)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="broken.parquet: cannot read parquet"):
        load_dataset(tmp_path / "broken.parquet")


def test_flashrag_parquet_detected_by_fields(tmp_path):
    path = _write_parquet([{"id": "d0", "question": "q?", "golden_answers": ["A"]}], tmp_path / "dev.parquet")
    assert load_dataset(path)[0].golds == ["A"] and load_dataset(path)[0].qid == "d0"


def test_load_datasets_concatenates_and_refuses_shared_ids(tmp_path):
    a = FIX / "r1_searcher/eval_set/hotpotqa_500.jsonl"
    b = FIX / "r1_searcher/eval_set/2wiki_500.jsonl"
    items = load_datasets([a, b])
    assert [i.qid for i in items] == ["hotpotqa_500-1", "hotpotqa_500-2", "hotpotqa_500-3", "2wiki_500-1", "2wiki_500-2"]
    assert load_datasets(str(a)) == load_dataset(a)
    with pytest.raises(DatasetError, match="also in"):
        load_datasets([a, a])


def test_config_lists_the_loaders_formats():
    """The config's format choices (the wire imports nothing of the actors) are the loader's."""
    from sonar.actors.datasets import ALIASES, FORMATS
    from sonar.cluster.wire.config import DATA_FORMATS

    assert set(DATA_FORMATS) == {"auto", *FORMATS, *ALIASES}


def test_upstream_eval_files_that_failed_before_now_load(tmp_path):
    """The issue's reproduction: R1-Searcher's hotpotqa_500/2wiki_500 were undetectable and musique_500
    was read as MuSiQue (missing 'id'); the same layout (first lines rewritten) now loads."""
    for name in ("hotpotqa_500.jsonl", "2wiki_500.jsonl", "musique_500.jsonl"):
        p = tmp_path / name
        p.write_text("\n".join(json.dumps({"idx": i + 1, "question": f"Invented question {i}?", "answer": f"A{i}",
                                           "gen_text_store": ""}) for i in range(3)) + "\n")
        items = load_dataset(p)
        assert [i.qid for i in items] == [f"{p.stem}-1", f"{p.stem}-2", f"{p.stem}-3"]
