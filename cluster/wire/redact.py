"""The one place secrets are taken out of text before it is saved, logged or shown.

``redact(text)`` drops the user-info of every URL in ``text``: ``scheme://user:pass@host`` becomes
``scheme://***@host``. A password is whatever lies between ``://`` and the *last* ``@`` before the
next URL, quote or line end, so an unencoded ``@`` (``user:p@ss@host``), a space
(``user:pa ss@host``) or a ``/`` (``user:pa/ss@host``) in it is removed whole, never left in part.
The price is over-redaction of a URL with no user-info but an ``@`` later on the same line
(``http://h/x?mail=a@b`` -> ``http://***@b``): redacting too much is safe, too little is not.

Query parameters named like secrets (``?token=``, ``&api_key=``, ``&X-Amz-Signature=``) keep their name
and lose their value (``?token=***``).

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


_SECRET_PARAM = re.compile(r"([?&;](?:[A-Za-z0-9_.\-]*(?:token|key|secret|password|passwd|signature|sig|auth|"
                           r"credential)[A-Za-z0-9_.\-]*)=)([^&;#\s\"']+)", re.IGNORECASE)
"""A URL query parameter whose name says it carries a secret (``?token=``, ``&api_key=``, ``X-Amz-Signature``)."""


def redact(text: str) -> str:
    """Every URL's user-info in ``text`` replaced by ``***``, and the value of every query parameter whose name
    says it is a secret (``token``, ``key``, ``secret``, ``password``, ``signature``, ``auth``, ...): see the
    module docstring."""
    if "=" in text:
        text = _SECRET_PARAM.sub(r"\1***", text)
    if "@" not in text:
        return text
    return _USERINFO.sub(r"\1***@", text)


def has_userinfo(url: str) -> bool:
    return "@" in url and _USERINFO.sub(r"\1***@", url) != url
