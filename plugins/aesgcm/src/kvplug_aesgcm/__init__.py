"""kvplug-aesgcm: the ``aesgcm`` serde, encryption at rest for every byte store.

Each value is sealed with AES-256-GCM under a key from a key file or an environment variable,
bound to the key it is stored under (so a value copied under another key does not open), and
names the id of the key that sealed it (so keys rotate: old values stay readable while new
ones are sealed with the new key). A value that was altered, moved, or sealed with a key this
reader does not hold is a counted miss, never data. See docs/encryption.md.
"""

from __future__ import annotations

from kvplug_aesgcm.keyring import Keyring, KeyringError
from kvplug_aesgcm.serde import AESGCMOptions, AESGCMSerde

__all__ = ["AESGCMOptions", "AESGCMSerde", "Keyring", "KeyringError"]
