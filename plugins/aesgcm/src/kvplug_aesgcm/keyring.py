"""The keys of the ``aesgcm`` serde: read from a key file or an environment variable, each with
an id, and the per-tenant keys derived from them.

Key material is a list of entries ``<id>:<key>``, one per line (a file) or separated by commas
(an environment variable); ``<id>`` is a whole number from 1 to 4294967295 and ``<key>`` is 32
random bytes in base64. Blank lines and lines starting with ``#`` are skipped::

    # kvplug aesgcm keys: the highest id seals new values unless key_id says otherwise
    1:3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=
    2:u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7u7s=

``kvplug-aesgcm-key 3 >> keys`` prints a new entry. No error or ``repr`` ever shows a key: they
name the entry's line and id only, and every key is registered with :mod:`kvplug.secrets` so
that a log line that quotes one by accident shows it masked.

Example::

    >>> keyring = Keyring.parse("1:" + "A" * 43 + "=", source="the example")
    >>> keyring.ids, keyring.sealing_id
    ((1,), 1)
    >>> len(keyring.data_key(1, tenant="team-a"))
    32
    >>> keyring.data_key(1, "team-a") != keyring.data_key(1, "team-b")
    True
    >>> keyring
    Keyring(ids=(1,), sealing_id=1, source='the example')
"""

from __future__ import annotations

import argparse
import base64
import binascii
import logging
import os
import stat
from pathlib import Path

from kvplug.errors import ConfigError
from kvplug.secrets import remember

logger = logging.getLogger(__name__)

KEY_BYTES = 32
"""AES-256 keys: 32 bytes."""
MAX_KEY_ID = 2**32 - 1
_HKDF_INFO = b"kvplug-aesgcm data key v1\x00"


class KeyringError(ConfigError):
    """The key material cannot be used: missing, malformed, or not the size of an AES-256 key.
    The message names where the material came from and which entry, never a key."""


class Keyring:
    """Master keys by id, the id that seals new values, and the data keys derived from them.

    Values are never sealed with a master key itself: each is sealed with a data key derived by
    HKDF-SHA256 from a master key and the value's tenant (``None``: no tenant, or per-tenant
    keys are off), so one tenant's data key opens nothing of another's.
    """

    def __init__(self, keys: dict[int, bytes], *, sealing_id: int | None, source: str) -> None:
        if not keys:
            raise KeyringError(
                f"{source} holds no key. Add one entry '<id>:<32 bytes in base64>' (make one "
                "with kvplug-aesgcm-key 1)."
            )
        chosen = max(keys) if sealing_id is None else sealing_id
        if chosen not in keys:
            raise KeyringError(
                f"key_id {chosen} is not in {source}, which holds ids "
                f"{', '.join(map(str, sorted(keys)))}. Add that key, or choose one of these ids."
            )
        self._keys = dict(keys)
        self.sealing_id = chosen
        """The id of the key that seals new values."""
        self.source = source
        """Where the keys came from (a file's path, an environment variable's name)."""

    @property
    def ids(self) -> tuple[int, ...]:
        """The ids of the keys held, ascending."""
        return tuple(sorted(self._keys))

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def __repr__(self) -> str:
        return f"Keyring(ids={self.ids}, sealing_id={self.sealing_id}, source={self.source!r})"

    def data_key(self, key_id: int, tenant: str | None) -> bytes:
        """The data key of ``tenant`` (None: no tenant) under master key ``key_id``; raises
        KeyError for an id not held. Derived anew each call: the serde keeps the ciphers."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = _HKDF_INFO + (b"" if tenant is None else b"tenant\x00" + tenant.encode())
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(
            self._keys[key_id]
        )

    @classmethod
    def parse(cls, text: str, *, source: str, sealing_id: int | None = None) -> Keyring:
        """The keys in ``text`` (entries by line or comma); ``source`` names it in errors."""
        keys: dict[int, bytes] = {}
        entries = [part for line in text.splitlines() for part in line.split(",")]
        for number, entry in enumerate(entries, 1):
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            where = f"entry {number} of {source}"
            key_id_text, colon, key_text = entry.partition(":")
            if not colon:
                raise KeyringError(
                    f"{where} is not '<id>:<key>' (it has no colon). Write each key as "
                    "'<id>:<32 bytes in base64>', e.g. the line kvplug-aesgcm-key prints."
                )
            try:
                key_id = int(key_id_text.strip())
            except ValueError:
                key_id = -1
            if not 1 <= key_id <= MAX_KEY_ID:
                raise KeyringError(
                    f"{where} has the id {key_id_text.strip()[:12]!r}; an id is a whole number "
                    f"from 1 to {MAX_KEY_ID}."
                )
            remember(key_text.strip())
            key = _decode_key(key_text.strip())
            if key is None:
                raise KeyringError(
                    f"{where} (id {key_id}) is not {KEY_BYTES} bytes in base64. Make a key with "
                    "kvplug-aesgcm-key, which prints a whole entry."
                )
            if key_id in keys:
                raise KeyringError(
                    f"{where} repeats id {key_id}. Each key needs its own id: values name the id "
                    "of the key that sealed them."
                )
            keys[key_id] = key
        return cls(keys, sealing_id=sealing_id, source=source)

    @classmethod
    def from_file(cls, path: Path, *, sealing_id: int | None = None) -> Keyring:
        """The keys in the file ``path``. A file that others than its owner may read is used,
        with a warning to ``chmod 600`` it."""
        source = f"the key file {path}"
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode
        except OSError as error:
            raise KeyringError(
                f"{source} cannot be read ({error.strerror or error}). Check serde_key_file and "
                "that this process may read the file."
            ) from None
        except UnicodeDecodeError:
            raise KeyringError(f"{source} is not text: expected lines '<id>:<key>'.") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "%s may be read by users other than its owner (mode %o); run chmod 600 on it",
                source,
                stat.S_IMODE(mode),
            )
        return cls.parse(text, source=source, sealing_id=sealing_id)

    @classmethod
    def from_env(cls, name: str, *, sealing_id: int | None = None) -> Keyring:
        """The keys in the environment variable ``name``."""
        source = f"the environment variable {name}"
        text = os.environ.get(name)
        if text is None:
            raise KeyringError(
                f"{source} is not set. Set it to '<id>:<key>' entries separated by commas (make "
                "one with kvplug-aesgcm-key 1), or name another variable in serde_key_env."
            )
        return cls.parse(text, source=source, sealing_id=sealing_id)


def _decode_key(text: str) -> bytes | None:
    for decode in (base64.b64decode, base64.urlsafe_b64decode):
        try:
            key = decode(text.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            continue
        if len(key) == KEY_BYTES:
            return key
    return None


def new_entry(key_id: int) -> str:
    """A new key-file entry: ``key_id`` and 32 random bytes in base64."""
    if not 1 <= key_id <= MAX_KEY_ID:
        raise ValueError(f"a key id is a whole number from 1 to {MAX_KEY_ID}, got {key_id}.")
    return f"{key_id}:{base64.b64encode(os.urandom(KEY_BYTES)).decode('ascii')}"


def main(argv: list[str] | None = None) -> None:
    """``kvplug-aesgcm-key ID``: print a new key entry (append it to the key file)."""
    parser = argparse.ArgumentParser(
        prog="kvplug-aesgcm-key",
        description="Print a new AES-256 key entry for the aesgcm serde's key file or variable.",
    )
    parser.add_argument("key_id", type=int, help=f"the new key's id, 1 to {MAX_KEY_ID}")
    args = parser.parse_args(argv)
    try:
        print(new_entry(args.key_id))
    except ValueError as error:
        parser.error(str(error))


__all__ = ["KEY_BYTES", "MAX_KEY_ID", "Keyring", "KeyringError", "main", "new_entry"]
