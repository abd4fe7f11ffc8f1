"""Issue 54, finding 2: one document (or question) with a lone UTF-16 surrogate, ``\\ud83d`` in its JSON (a
truncated emoji in scraped text), crashed every rollout worker that retrieved it (a tokenizer ``TypeError``),
``sonar index`` (tantivy's ``UnicodeEncodeError``) and start-up. Every entry of outside text now goes
through ``cluster/wire/text.py: clean_text``: the corpus reader, the dataset loader, the HTTP and
Elasticsearch hit parsers, the reranker's passage text and the token door ``prompts.neutralise``."""
import json

import pytest

from sonar.cluster.wire.text import REPLACEMENT, clean_text

LONE = json.loads('"\\ud83d"')  # what json.loads makes of the escape: a str holding one lone surrogate


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sonar.retrieval.rerank import packaged_minilm_dir

    return AutoTokenizer.from_pretrained(str(packaged_minilm_dir()))


def test_clean_text_replaces_lone_surrogates_and_joins_split_pairs(tokenizer):
    with pytest.raises(TypeError):
        tokenizer(f"smile {LONE} here")  # what crashed the workers
    assert clean_text(f"smile {LONE} here") == f"smile {REPLACEMENT} here"
    assert clean_text("\ud83d\ude00") == "\U0001F600"  # a pair that arrived as two code points
    plain = "nothing to repair: é, 日本, \U0001F600"
    assert clean_text(plain) is plain
    assert tokenizer(clean_text(f"smile {LONE} here"))["input_ids"]


def test_a_corpus_document_with_one_is_indexed_and_searched(tmp_path, tokenizer):
    import dataclasses

    from sonar.cluster.wire.config import RetrievalConfig
    from sonar.retrieval.corpus import CorpusReader
    from sonar.retrieval.factory import build_retriever
    from sonar.retrieval.rerank import passage_text

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "d1", "title": "Emoji\\ud83d", "text": "a truncated emoji \\ud83d in scraped text"}\n'
                      '{"id": "d2", "title": "Other", "text": "an ordinary passage"}\n')
    (p, _) = list(CorpusReader(corpus))
    assert p.text == f"a truncated emoji {REPLACEMENT} in scraped text" and p.title == f"Emoji{REPLACEMENT}"
    r = build_retriever(dataclasses.replace(RetrievalConfig(), cache_size=0), str(corpus), str(tmp_path / "ix"))
    (hits,) = r.batch_search(["truncated emoji"], 1)
    assert hits[0].doc_id == "d1" and tokenizer(passage_text(hits[0]))["input_ids"]


def test_http_and_elasticsearch_hits_with_one_are_repaired():
    from sonar.retrieval.http_backend import parse_answer

    raw = b'{"result": [[{"document": {"id": "x\\ud83d", "contents": "\\"T\\ud83d\\"\\nbody \\ud83d"}, "score": 1.0}]]}'
    (hits,) = parse_answer(raw, 1, 1)
    assert (hits[0].doc_id, hits[0].title, hits[0].text) == (f"x{REPLACEMENT}", f"T{REPLACEMENT}", f"body {REPLACEMENT}")
    from sonar.retrieval.elastic import ElasticRetriever

    es = ElasticRetriever(client=None, index="i", hosts=["http://127.0.0.1:9200"])  # the _msearch answer's parser
    answer = json.loads('{"hits": {"hits": [{"_id": "e\\ud83d", "_score": 2.0, '
                        '"_source": {"title": "T\\ud83d", "text": "body \\ud83d"}}]}}')
    ((hit,),) = es._parse(1, 1, [0], [answer])
    assert (hit.doc_id, hit.title, hit.text) == (f"e{REPLACEMENT}", f"T{REPLACEMENT}", f"body {REPLACEMENT}")


def test_a_dataset_question_with_one_loads_and_a_plugins_hit_is_neutralised(tmp_path, tokenizer):
    from sonar.actors.datasets import load_datasets
    from sonar.actors.prompts import neutralise

    data = tmp_path / "dev.jsonl"
    data.write_text('{"id": "q1", "question": "who wrote \\ud83d this?", "golden_answers": ["a\\ud83d"]}\n')
    (item,) = load_datasets([str(data)])
    assert item.question == f"who wrote {REPLACEMENT} this?" and item.golds == [f"a{REPLACEMENT}"]
    # a retriever or tool plug-in may hand over anything: the token door repairs it too
    assert tokenizer(neutralise(f"doc {LONE}", ["</documents>"]))["input_ids"]
