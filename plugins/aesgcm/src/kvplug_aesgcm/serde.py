"""The ``aesgcm`` serde: each payload sealed with AES-256-GCM, bound to its key and layout.

Payload layout (little-endian)::

    0   version      u8   1
    1   flags        u8   bit 0: the data key was derived for the value's tenant
    2   reserved     u16  zero
    4   key id       u32  the master key that sealed it (the keyring's ids)
    8   nonce        12   random, new for every value
    20  ciphertext        as many bytes as the object
    ..  tag          16   GCM's authentication tag

The associated data (authenticated, not stored) is the payload's first 20 bytes, the object's
shape, dtype and format, and the key's string form: a value copied under another key, or given
another shape in its frame header, does not open. Sealing and opening write straight into the
payload and the object's memory (``encrypt_into``/``decrypt_into``): no copy besides the cipher.

Options (in a backend's URL or config, each with the ``serde_`` prefix):

* ``key_file``: a file of ``<id>:<key>`` lines (:mod:`kvplug_aesgcm.keyring`); or
* ``key_env``: the name of an environment variable holding the entries, comma-separated;
* ``key_id``: the id that seals new values (default: the highest held); every id held opens;
* ``per_tenant``: seal each tenant's values with a key derived for that tenant
  (:attr:`kvplug.keys.CacheKey.tenant`), so one tenant's key opens nothing of another's.

Example::

    >>> import os, torch
    >>> from kvplug.keys import CacheKey
    >>> from kvplug.memory import MemoryObj
    >>> from kvplug.serde import open_serde
    >>> os.environ["EXAMPLE_KVPLUG_KEYS"] = "7:" + "B" * 43 + "="
    >>> serde = open_serde("aesgcm", {"key_env": "EXAMPLE_KVPLUG_KEYS"})
    >>> key = CacheKey("llama", 1, 0, 0x2A, "half")
    >>> src = MemoryObj.from_tensor(torch.arange(8, dtype=torch.float16))
    >>> sealed = serde.encode(src, key)
    >>> len(sealed) - src.nbytes
    36
    >>> out = MemoryObj.from_tensor(torch.zeros(8, dtype=torch.float16))
    >>> serde.decode(memoryview(sealed), out, key)
    >>> torch.equal(out.tensor, src.tensor)
    True
    >>> try:
    ...     serde.decode(memoryview(sealed), out, CacheKey("llama", 1, 0, 0x2B, "half"))
    ... except CorruptObject as error:
    ...     print(str(error).split(":")[0])
    aesgcm value of llama@1@0@2b@half does not authenticate
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvplug.errors import ConfigError, CorruptObject, UnreadableObject
from kvplug.memory import MemoryObj
from kvplug.serde import Serde
from kvplug_aesgcm.keyring import MAX_KEY_ID, Keyring

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvplug.keys import CacheKey

VERSION = 1
FLAG_PER_TENANT = 0x01
_PREFIX = struct.Struct("<BBHI")
NONCE_BYTES = 12
TAG_BYTES = 16
PREFIX_BYTES = _PREFIX.size + NONCE_BYTES
OVERHEAD = PREFIX_BYTES + TAG_BYTES
"""Bytes a sealed payload has beyond the object's."""


class AESGCMOptions(BaseModel):
    """Options of the ``aesgcm`` serde (given as ``serde_<name>`` on a backend)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_file: Path | None = Field(None, description="file of '<id>:<base64 key>' lines")
    key_env: str | None = Field(None, description="environment variable holding the keys")
    key_id: int | None = Field(
        None, ge=1, le=MAX_KEY_ID, description="id of the key that seals new values"
    )
    per_tenant: bool = Field(False, description="derive a key per tenant from the master key")

    @model_validator(mode="after")
    def _one_source(self) -> AESGCMOptions:
        if (self.key_file is None) == (self.key_env is None):
            raise ValueError(
                "give the keys in exactly one place: serde_key_file=<path> or "
                "serde_key_env=<variable name>"
            )
        return self


class AESGCMSerde(Serde):
    """AES-256-GCM over each payload; see the module's description for layout and options."""

    name = "aesgcm"
    description = (
        "encryption at rest: AES-256-GCM bound to the key (key_file/key_env, key_id, per_tenant)"
    )
    Options: ClassVar[type[BaseModel] | None] = AESGCMOptions
    authenticated = True

    def __init__(self, options: AESGCMOptions) -> None:
        if options.key_file is not None:
            self.keyring = Keyring.from_file(options.key_file, sealing_id=options.key_id)
        else:
            assert options.key_env is not None
            self.keyring = Keyring.from_env(options.key_env, sealing_id=options.key_id)
        self.per_tenant = options.per_tenant
        self._ciphers: dict[tuple[int, str | None], AESGCM] = {}

    def __repr__(self) -> str:
        return f"AESGCMSerde({self.keyring!r}, per_tenant={self.per_tenant})"

    def _cipher(self, key_id: int, tenant: str | None) -> AESGCM:
        cipher = self._ciphers.get((key_id, tenant))
        if cipher is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            cipher = AESGCM(self.keyring.data_key(key_id, tenant))
            if len(self._ciphers) >= 4096:
                self._ciphers.clear()
            self._ciphers[(key_id, tenant)] = cipher
        return cipher

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytearray:
        payload = bytearray(OVERHEAD + obj.nbytes)
        self.seal_into(obj, key, memoryview(payload))
        return payload

    def seal_into(self, obj: MemoryObj, key: CacheKey | None, payload: memoryview) -> None:
        """:meth:`encode` into ``payload`` (``OVERHEAD`` bytes more than ``obj``): the
        ciphertext goes straight to memory the caller stores from."""
        if key is None:
            raise ConfigError(
                "the aesgcm serde binds each value to the key it is stored under, and was given "
                "none: use it through a store (the serde option of a byte store)."
            )
        if payload.nbytes != OVERHEAD + obj.nbytes:
            raise ValueError(
                f"a sealed payload takes {OVERHEAD + obj.nbytes} bytes, not {payload.nbytes}."
            )
        flags = FLAG_PER_TENANT if self.per_tenant and key.tenant else 0
        tenant = key.tenant if flags else None
        key_id = self.keyring.sealing_id
        _PREFIX.pack_into(payload, 0, VERSION, flags, 0, key_id)
        nonce = os.urandom(NONCE_BYTES)
        payload[_PREFIX.size : PREFIX_BYTES] = nonce
        self._cipher(key_id, tenant).encrypt_into(
            nonce, _plain(obj), _associated_data(payload, obj, key), payload[PREFIX_BYTES:]
        )

    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        if key is None:
            raise ConfigError("aesgcm opens a value only with the key it is stored under.")
        if payload.nbytes != OVERHEAD + out.nbytes:
            raise CorruptObject(
                f"aesgcm value of {key} has {payload.nbytes} bytes; shape {out.shape} "
                f"{out.dtype} sealed takes {OVERHEAD + out.nbytes}."
            )
        version, flags, reserved, key_id = _PREFIX.unpack_from(payload)
        if version != VERSION or reserved or flags & ~FLAG_PER_TENANT:
            raise CorruptObject(
                f"aesgcm value of {key} has version {version}, flags {flags:#x}: not one this "
                f"kvplug-aesgcm writes (version {VERSION}). Upgrade kvplug-aesgcm, or the value "
                "was altered."
            )
        if key_id not in self.keyring:
            raise UnreadableObject(
                f"aesgcm value of {key} was sealed with key id {key_id}, which "
                f"{self.keyring.source} does not hold (it holds ids "
                f"{', '.join(map(str, self.keyring.ids))}). Add that key to read it."
            )
        tenant = (key.tenant or None) if flags & FLAG_PER_TENANT else None
        if flags & FLAG_PER_TENANT and tenant is None:
            raise CorruptObject(
                f"aesgcm value of {key} was sealed with a tenant's key, but the key names no "
                "tenant: it was moved here from another key."
            )
        from cryptography.exceptions import InvalidTag

        nonce = payload[_PREFIX.size : PREFIX_BYTES]
        sealed = payload[PREFIX_BYTES:]
        try:
            _open_into(
                self._cipher(key_id, tenant),
                nonce,
                sealed,
                _associated_data(payload, out, key),
                out,
            )
        except InvalidTag:
            raise CorruptObject(
                f"aesgcm value of {key} does not authenticate: it was altered, moved here from "
                f"another key, or sealed with another key under id {key_id}."
            ) from None


def _associated_data(payload: bytearray | memoryview, obj: MemoryObj, key: CacheKey) -> bytes:
    layout = f"{tuple(obj.shape)}|{obj.dtype}|{int(obj.fmt)}|{key.to_string()}"
    return bytes(payload[: _PREFIX.size]) + layout.encode()


def _plain(obj: MemoryObj) -> Any:
    if obj.device.type == "cpu":
        return obj.memoryview()
    return obj.raw.cpu().numpy()


def _open_into(
    cipher: AESGCM, nonce: memoryview, sealed: memoryview, aad: bytes, out: MemoryObj
) -> None:
    if out.device.type == "cpu":
        cipher.decrypt_into(bytes(nonce), sealed, aad, out.memoryview())
        return
    import torch

    plain = bytearray(out.nbytes)
    cipher.decrypt_into(bytes(nonce), sealed, aad, plain)
    out.raw.copy_(torch.frombuffer(plain, dtype=torch.uint8))


__all__ = ["OVERHEAD", "AESGCMOptions", "AESGCMSerde"]
