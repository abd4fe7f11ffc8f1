"""One URL redaction everywhere (config.yaml, MLflow params, Elasticsearch host names) and no
environment secret copied into the saved config: the issue's exact examples."""
import pytest

from sonar.cluster.wire.config import ConfigError, flatten, load_config, to_dict, to_yaml
from sonar.cluster.wire.redact import has_userinfo, redact
from sonar.retrieval.elastic import redact_url


@pytest.mark.parametrize("url, expected", [
    ("https://user:p@ss@host:9200/x", "https://***@host:9200/x"),        # unencoded @ in the password
    ("https://user:pa ss@host:9200", "https://***@host:9200"),           # a space
    ("https://user:pa/ss@host:9200/idx", "https://***@host:9200/idx"),   # a slash
    ("https://user:a@b c/d@host", "https://***@host"),                   # all three at once
    ("http://alice:s3cret@mlflow.example:5000", "http://***@mlflow.example:5000"),
    ("postgresql://u:p%40w@db/mlflow", "postgresql://***@db/mlflow"),    # an encoded @
    ("https://host:9200/x", "https://host:9200/x"),                      # nothing to redact
    ("sqlite:////tmp/run/mlflow.db", "sqlite:////tmp/run/mlflow.db"),
])
def test_redact_removes_the_whole_userinfo(url, expected):
    assert redact(url) == expected
    assert redact_url(url) == expected  # Elasticsearch uses the same function
    assert has_userinfo(url) == (url != expected)


def test_redact_in_text_stops_at_quotes_line_ends_and_the_next_url():
    text = ('hosts: ["http://a:9200", "https://bob:hun@ter2@b:9200"]\n'
            "uri: https://u:p w@m:5000 # x@y\nplain: mail@example.com")
    out = redact(text)
    assert "hun" not in out and "ter2" not in out and "p w" not in out
    assert '"http://a:9200"' in out and '"https://***@b:9200"' in out
    assert "plain: mail@example.com" in out  # no scheme: not a URL


def test_saved_config_and_params_hold_no_part_of_the_password():
    cfg = load_config([], ["tracking.uri=https://user:p@ss w/rd@mlflow.example:5000",
                           "retrieval.elastic.hosts=[https://bob:p@ss@es.example:9200]"])
    for text in (to_yaml(cfg), " ".join(flatten(to_dict(cfg)).values())):
        assert "p@ss" not in text and "ss@" not in text and "w/rd" not in text and "user:" not in text
        assert "https://***@mlflow.example:5000" in text and "https://***@es.example:9200" in text


@pytest.mark.parametrize("override", [
    "retrieval.elastic.api_key_env=${oc.env:ES_API_KEY}",
    "retrieval.elastic.password_env=${oc.env:ES_PASSWORD}",
    "retrieval.elastic.password_env=${env:ES_PASSWORD}",  # the legacy spelling
])
def test_env_interpolation_into_secret_fields_is_refused(monkeypatch, override):
    monkeypatch.setenv("ES_API_KEY", "k-123-secret")
    monkeypatch.setenv("ES_PASSWORD", "hunter2")
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ".*environment interpolation") as e:
        load_config([], [override])
    assert "hunter2" not in str(e.value) and "k-123" not in str(e.value)


def test_env_interpolation_in_a_yaml_file_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKEN", "t0ps3cret")
    p = tmp_path / "c.yaml"
    p.write_text("retrieval:\n  elastic:\n    api_key_env: ${oc.env:TOKEN}\n")
    with pytest.raises(ConfigError, match=r"retrieval\.elastic\.api_key_env") as e:
        load_config([p])
    assert "t0ps3cret" not in str(e.value)


def test_env_interpolation_into_other_fields_still_works(monkeypatch):
    monkeypatch.setenv("SONAR_EXP", "nightly")
    assert load_config([], ["tracking.experiment=${oc.env:SONAR_EXP}"]).tracking.experiment == "nightly"


def test_secret_query_parameters_lose_their_values_everywhere(monkeypatch, tmp_path):
    """Issue 54, finding 7: ``?key=${oc.env:TOKEN}`` in a URL field loaded and the token reached config.yaml
    and the MLflow params; ``?token=`` / ``?api_key=`` were not redacted."""
    from sonar.cluster.wire.config import to_yaml
    from sonar.cluster.wire.redact import has_userinfo, redact

    assert redact("http://h/retrieve?key=abc&topk=3") == "http://h/retrieve?key=***&topk=3"
    assert redact("https://s3/x?X-Amz-Signature=f00&api_key=k1;token=t2#frag") == \
        "https://s3/x?X-Amz-Signature=***&api_key=***;token=***#frag"
    assert redact("http://h/search?q=monkey&page=2") == "http://h/search?q=monkey&page=2"  # not secrets
    assert not has_userinfo("http://h/retrieve?token=abc")  # a query secret is not user-info: hosts stay allowed
    monkeypatch.setenv("TOKEN", "t0ps3cret")
    cfg = load_config([], ["retrieval.backend=http", "retrieval.http.url=http://h:8000/retrieve?key=${oc.env:TOKEN}"])
    assert cfg.retrieval.http.url.endswith("?key=t0ps3cret")  # the run itself still sends it
    assert "t0ps3cret" not in to_yaml(cfg)
    from sonar.retrieval.http_backend import HTTPRetriever

    assert "t0ps3cret" not in HTTPRetriever.from_config(cfg.retrieval).name

