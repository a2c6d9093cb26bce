"""How the ``lm://`` client's keys travel: LMCache's key string as it is wherever the server's
key rules allow it (so LMCache clients share the object), else escaped (extended mode)."""

from __future__ import annotations

import base64

from kvplug_lm import wire

ESCAPED_KEY_MARK = "~kvplug-b64~"
"""How an escaped key begins on the wire (:func:`encode_key`)."""


def clean(raw: bytes) -> bool:
    """Whether the server's key rules take ``raw`` as it is."""
    try:
        wire.check_key(raw, len(raw) or 1)
    except wire.WireError:
        return False
    return True


def travels_plain(raw: bytes) -> bool:
    """Whether ``raw`` can travel in LMCache's plain protocol."""
    return len(raw) <= wire.PLAIN_KEY_BYTES and clean(raw)


def encode_key(text: str) -> bytes:
    """``text`` on the wire in the extended mode: as it is when the server's key rules allow
    it (every key an LMCache client makes), else :data:`ESCAPED_KEY_MARK` and its UTF-8 in
    URL-safe base64 (model names with spaces, control or invisible characters). A clean key
    that itself begins with the mark is escaped too, so two keys never meet on the wire."""
    raw = text.encode()
    if clean(raw) and not text.startswith(ESCAPED_KEY_MARK):
        return raw
    return (ESCAPED_KEY_MARK + base64.urlsafe_b64encode(raw).decode("ascii")).encode()


def decode_key(raw: bytes) -> str | None:
    """The key string :func:`encode_key` made ``raw`` from; None for bytes it cannot have
    made."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None
    if not text.startswith(ESCAPED_KEY_MARK):
        return text or None
    try:
        return base64.urlsafe_b64decode(text[len(ESCAPED_KEY_MARK) :]).decode()
    except (ValueError, UnicodeDecodeError):
        return None


__all__ = ["ESCAPED_KEY_MARK", "clean", "decode_key", "encode_key", "travels_plain"]
