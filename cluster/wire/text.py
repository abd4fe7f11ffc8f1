"""The one normalisation of text from outside (corpus files, dataset files, search hits from Elasticsearch,
an HTTP server or a plug-in, tool output): every entry calls :func:`clean_text` before the text reaches a
tokenizer, an index or a log.

What it repairs: lone UTF-16 surrogates (U+D800-U+DFFF without their pair). ``"\\ud83d"`` is a valid JSON
escape (a truncated emoji in scraped text), so ``json.loads`` gives a ``str`` holding one, which no UTF-8
encoder accepts: the tokenizers raise ``TypeError``, tantivy ``UnicodeEncodeError``. Each becomes U+FFFD
(the replacement character); a pair that arrived as two code points is joined into its character. Text
without surrogates is returned as it is (one regex scan). Pure: standard library only.
"""
from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")

REPLACEMENT = "\ufffd"


def clean_text(s: str) -> str:
    """``s`` with every lone surrogate replaced by U+FFFD and split pairs joined (see the module docstring)."""
    if not _SURROGATE.search(s):
        return s
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
