"""API keys of the frontend: `Authorization: Bearer <key>` on the REST API (or `x-api-key: <key>`,
as Anthropic's clients send it), the same value in the `authorization` metadata of the gRPC
Inference API.

Keys come from three places, all of them accepted together: `--api-keys` (visible in the process
list: prefer the others), `--api-keys-file` (one key per line; blank lines and lines starting
with `#` are skipped) and the environment variable TANDEM_API_KEYS (comma-separated). No key
anywhere: authentication is off.
"""
from __future__ import annotations

import hmac
import os
import pathlib
from collections.abc import Iterable, Mapping

from tandem.errors import InvalidRequest, Unauthenticated

ENV_VAR = "TANDEM_API_KEYS"
_SCHEME = "bearer "


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in dict.fromkeys(k.strip() for k in keys) if k)

    @classmethod
    def load(cls, keys: Iterable[str], keys_file: str = "",
             environ: Mapping[str, str] | None = None) -> ApiKeys:
        """The union of `keys`, the lines of `keys_file` and $TANDEM_API_KEYS."""
        found = list(keys)
        if keys_file:
            try:
                lines = pathlib.Path(keys_file).read_text().splitlines()
            except OSError as exc:
                raise InvalidRequest(f"cannot read --api-keys-file {keys_file}: {exc.strerror}",
                                     param="api_keys_file") from None
            found += [line for line in lines if not line.lstrip().startswith("#")]
        found += (os.environ if environ is None else environ).get(ENV_VAR, "").split(",")
        return cls(found)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None, api_key: str | None = None) -> None:
        """Passes when authentication is off, `authorization` is "Bearer <a known key>", or
        (without an Authorization header) `api_key`, the x-api-key header, is a known key.

        Raises:
            Unauthenticated: no key, another scheme, or an unknown key.
        """
        if not self._keys:
            return
        if not authorization and api_key:
            given = api_key.strip().encode()
        elif not authorization or not authorization[:len(_SCHEME)].lower() == _SCHEME:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' or "
                                  "'x-api-key: <key>'")
        else:
            given = authorization[len(_SCHEME):].strip().encode()
        # Compare with every key, in constant time, so timing tells nothing about a near miss.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise Unauthenticated("incorrect API key provided")
