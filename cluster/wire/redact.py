"""The one place secrets are taken out of text before it is saved, logged or shown.

``redact(text)`` drops the user-info of every URL in ``text``: ``scheme://user:pass@host`` becomes
``scheme://***@host``. A password is whatever lies between ``://`` and the *last* ``@`` before the
next URL, quote or line end, so an unencoded ``@`` (``user:p@ss@host``), a space
(``user:pa ss@host``) or a ``/`` (``user:pa/ss@host``) in it is removed whole, never left in part.
The price is over-redaction of a URL with no user-info but an ``@`` later on the same line
(``http://h/x?mail=a@b`` -> ``http://***@b``): redacting too much is safe, too little is not.

``has_userinfo(url)``: whether ``redact`` would change it (the Elasticsearch client refuses such hosts).

``SECRET_FIELD`` matches config field names that may hold (or name) a secret; ``cluster/wire/config.py``
refuses environment interpolation (``${oc.env:...}``) into them, so that an environment secret is never
copied into ``config.yaml`` or the MLflow params.
"""
from __future__ import annotations

import re

# scheme://, then user-info up to the last '@' before a line end, a quote or the next scheme://.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)((?:(?![A-Za-z][A-Za-z0-9+.\-]*://)[^\n\r\"'])*)@")

SECRET_FIELD = re.compile(r"password|passwd|token|secret|api|key|credential|auth", re.IGNORECASE)
"""Field names that may hold or name a secret (``api_key_env``, ``password``, ``token``, ...)."""

ENV_INTERPOLATION = re.compile(r"\$\{\s*(?:oc\.)?env\s*:", re.IGNORECASE)
"""An OmegaConf environment interpolation (``${oc.env:VAR}``, legacy ``${env:VAR}``)."""


def redact(text: str) -> str:
    """Every URL's user-info in ``text`` replaced by ``***`` (see the module docstring)."""
    if "@" not in text:
        return text
    return _USERINFO.sub(r"\1***@", text)


def has_userinfo(url: str) -> bool:
    return redact(url) != url
