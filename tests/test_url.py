"""Unit tests of kvplug.url: BackendURL parsing, password masking, hostile input, chains."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError, InvalidBackendURL
from kvplug.url import MAX_URL_LENGTH, BackendURL, split_chain

SECRET = "s3cr3t-Pa55"


# --------------------------------------------------------------------------- valid forms


@pytest.mark.parametrize(
    ("text", "scheme", "hosts", "path", "username", "password", "options"),
    [
        ("cpu://", "cpu", (), "", None, None, {}),
        ("cpu://?max_size=5GiB", "cpu", (), "", None, None, {"max_size": "5GiB"}),
        ("file:///a/b", "file", (), "/a/b", None, None, {}),
        ("file:///nvme0/kv,/nvme1/kv", "file", (), "/nvme0/kv,/nvme1/kv", None, None, {}),
        ("redis://h:6379/0", "redis", (("h", 6379),), "/0", None, None, {}),
        ("redis://cache-1", "redis", (("cache-1", None),), "", None, None, {}),
        (
            "rediss://user:pass@h:6380?ssl_cert_reqs=none",
            "rediss",
            (("h", 6380),),
            "",
            "user",
            "pass",
            {"ssl_cert_reqs": "none"},
        ),
        (
            "redis+sentinel://u:p@h1:1,h2:2/mymaster",
            "redis+sentinel",
            (("h1", 1), ("h2", 2)),
            "/mymaster",
            "u",
            "p",
            {},
        ),
        ("unix:///tmp/r.sock", "unix", (), "/tmp/r.sock", None, None, {}),
        ("redis://[::1]:6379", "redis", (("::1", 6379),), "", None, None, {}),
        ("redis://[2001:db8::7]", "redis", (("2001:db8::7", None),), "", None, None, {}),
        (
            "redis://u:p%40ss%3Aw%2Fd@h:65535",
            "redis",
            (("h", 65535),),
            "",
            "u",
            "p@ss:w/d",
            {},
        ),
        ("redis://:onlypass@h:1", "redis", (("h", 1),), "", None, "onlypass", {}),
        ("redis://onlyuser@h:1", "redis", (("h", 1),), "", "onlyuser", None, {}),
        (
            "redis://u%40corp:pw@10.0.0.1:6379",
            "redis",
            (("10.0.0.1", 6379),),
            "",
            "u@corp",
            "pw",
            {},
        ),
        (
            "lm://h:65432?a=1&b=&c=x%20y",
            "lm",
            (("h", 65432),),
            "",
            None,
            None,
            {"a": "1", "b": "", "c": "x y"},
        ),
        ("redis-sentinel://h:26379", "redis-sentinel", (("h", 26379),), "", None, None, {}),
        ("x.y-z+w://h", "x.y-z+w", (("h", None),), "", None, None, {}),
        ("file:///with%20space/kv", "file", (), "/with space/kv", None, None, {}),
    ],
)
def test_parse_valid_forms(
    text: str,
    scheme: str,
    hosts: tuple,
    path: str,
    username: str | None,
    password: str | None,
    options: dict,
) -> None:
    url = BackendURL.parse(text)
    assert url.scheme == scheme
    assert url.hosts == hosts
    assert url.path == path
    assert url.username == username
    assert url.password == password
    assert url.options == options
    assert url.host == (hosts[0][0] if hosts else None)
    assert url.port == (hosts[0][1] if hosts else None)
    assert BackendURL.parse(url.secret_url()) == url
    assert BackendURL.parse(str(url)).password in (None, "***")


def test_parse_returns_backend_url_unchanged() -> None:
    url = BackendURL.parse("cpu://")
    assert BackendURL.parse(url) is url


def test_base_scheme() -> None:
    assert BackendURL.parse("redis+sentinel://h").base_scheme == "redis"
    assert BackendURL.parse("rediss://h").base_scheme == "rediss"


def test_options_is_a_fresh_dict() -> None:
    url = BackendURL.parse("cpu://?a=1")
    url.options["a"] = "2"
    assert url.options == {"a": "1"}


def test_url_is_immutable_and_hashable() -> None:
    url = BackendURL.parse("redis://h:1")
    with pytest.raises(AttributeError):
        url.scheme = "x"  # type: ignore[misc]
    assert url == BackendURL.parse("redis://h:1")
    assert len({url, BackendURL.parse("redis://h:1")}) == 1


def test_str_of_simple_urls_is_the_input() -> None:
    for text in (
        "cpu://",
        "file:///a/b",
        "file:///nvme0/kv,/nvme1/kv",
        "redis://h:6379/0",
        "redis+sentinel://h1:1,h2:2/mymaster?db=2",
        "redis://[::1]:6379",
        "unix:///tmp/r.sock",
    ):
        assert str(BackendURL.parse(text)) == text


# --------------------------------------------------------------------------- masking


def test_password_is_masked_in_str_repr_format_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = BackendURL.parse(f"rediss://app:{SECRET}@h:6380/0?ssl_cert_reqs=none")
    assert str(url) == "rediss://app:***@h:6380/0?ssl_cert_reqs=none"
    assert repr(url) == "BackendURL('rediss://app:***@h:6380/0?ssl_cert_reqs=none')"
    assert SECRET not in f"{url} {url!r} {url!s}"
    assert SECRET not in "%s %r" % (url, url)  # noqa: UP031
    assert SECRET not in str([url]) + str({"u": url})
    logger = logging.getLogger("kvplug.test_url")
    with caplog.at_level(logging.DEBUG, logger="kvplug.test_url"):
        logger.info("connecting to %s", url)
        logger.info("connecting to %r", url)
        logger.info(f"connecting to {url}")
        logger.info("urls %s", [url])
    assert "connecting to rediss://app:***@h" in caplog.text
    assert SECRET not in caplog.text
    assert url.password == SECRET


def test_percent_encoded_password_is_masked_and_secret_url_round_trips() -> None:
    url = BackendURL.parse("redis://user:p%40ss%3Aword@h:6379")
    assert url.password == "p@ss:word"
    assert "p@ss" not in str(url) and "p%40ss" not in str(url)
    assert url.secret_url() == "redis://user:p%40ss%3Aword@h:6379"
    assert BackendURL.parse(url.secret_url()).password == "p@ss:word"


def test_secret_url_round_trips_with_every_part() -> None:
    url = BackendURL.parse(
        "redis+sentinel://us%3Aer:p%2F%3F%23%40w@h1:1,[::1]:2/master?db=2&ssl=true"
    )
    assert url.username == "us:er"
    assert url.password == "p/?#@w"
    assert BackendURL.parse(url.secret_url()) == url
    assert "p/?#@w" not in str(url) and "p%2F" not in str(url)


@settings(max_examples=200, deadline=None)
@given(
    username=st.text(min_size=1, max_size=20),
    password=st.text(min_size=1, max_size=30),
)
def test_secret_url_round_trips_random_credentials(username: str, password: str) -> None:
    from urllib.parse import quote

    text = f"redis://{quote(username, safe='')}:{quote(password, safe='')}@h:6379/0"
    url = BackendURL.parse(text)
    assert url.username == username and url.password == password
    assert BackendURL.parse(url.secret_url()) == url
    assert str(url) == f"redis://{quote(username, safe='')}:***@h:6379/0"


@pytest.mark.parametrize(
    "text",
    [
        f"redis://user:{SECRET}@h:0",
        f"redis://user:{SECRET}@h:65536",
        f"redis://user:{SECRET}@h:abc",
        f"redis://user:{SECRET}@[::1",
        f"redis://user:{SECRET}@[::1]x",
        f"redis://user:{SECRET}@bad host:1",
        f"redis://user:{SECRET}@h:1?x=1&x=2",
        f"redis://user:{SECRET}@h:1?novalue",
        f"redis://user:{SECRET}@h:1#frag",
        f"redis://user:{SECRET}@h:1/\x00",
        f"redis://user:{SECRET}@h:1\r\nAUTH x",
        f"REDIS://user:{SECRET}@h:1",
        f"redis://user:{SECRET}@h:1,",
        f"redis://user:{SECRET}@@h:0",
        f"redis://us@er:{SECRET}@h:0",
        f"redis://user:{SECRET}@h:1/" + "x" * (MAX_URL_LENGTH + 10),
        f"redis://user:{SECRET}" + "y" * MAX_URL_LENGTH + "@h:1",
    ],
)
def test_invalid_url_error_never_shows_the_password(text: str) -> None:
    with pytest.raises(InvalidBackendURL) as info:
        BackendURL.parse(text)
    message = str(info.value)
    assert SECRET not in message
    assert "s3cr" not in message
    assert "***" in message


def test_password_with_raw_at_sign_is_masked_whole_in_errors() -> None:
    with pytest.raises(InvalidBackendURL) as info:
        BackendURL.parse("redis://user:top@secret@h:0")
    assert "top" not in str(info.value)
    assert "secret" not in str(info.value)
    assert "port '0'" in str(info.value)


def test_chain_error_never_shows_the_password() -> None:
    for text in (f"audit::::redis://u:{SECRET}@h", f"audit://?x=1::::redis://u:{SECRET}@h"):
        with pytest.raises(InvalidBackendURL) as info:
            split_chain(text)
        assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        f"redis://user:1/{SECRET}@h:6379",  # once read as host 'user', port 1, path '/...@h:6379'
        f"redis://user:1?x={SECRET}@h:6379",  # once read as a query x='...@h:6379'
        f"redis://user:{SECRET}@h:1/db@x",
        f"redis://user:a://{SECRET}@h:1",
    ],
)
def test_url_whose_password_end_is_ambiguous_is_refused_without_showing_it(text: str) -> None:
    with pytest.raises(InvalidBackendURL) as info:
        BackendURL.parse(text)
    assert SECRET not in str(info.value) and "ambiguous" in str(info.value)
    assert "%2F" in str(info.value)


def test_secret_named_query_values_are_masked_but_reach_the_client() -> None:
    url = BackendURL.parse(f"acme://h:1?api_key={SECRET}&shard=2")
    assert str(url) == "acme://h:1?api_key=***&shard=2"
    assert url.options["api_key"] == SECRET
    assert url.secret_url() == f"acme://h:1?api_key={SECRET}&shard=2"
    assert str(url.with_options(token=SECRET)) == "acme://h:1?api_key=***&shard=2&token=***"


# --------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "no '://'"),
        ("cpu", "no '://'"),
        ("cpu:/", "no '://'"),
        ("redis:h:6379", "no '://'"),
        ("://h", "scheme ''"),
        ("CPU://", "scheme 'CPU'"),
        ("Redis://h", "scheme"),
        ("1redis://h", "scheme"),
        ("red_is://h", "scheme"),
        ("red!s://h", "scheme"),
        ("rédis://h", "scheme"),
        ("redis ://h", "whitespace"),
        ("redis://h :1", "whitespace"),
        (" cpu://", "whitespace"),
        ("cpu://\t", "whitespace"),
        ("redis://h:1\nSET x 1", "control"),
        ("redis://h:1\r\nFLUSHALL", "control"),
        ("redis://h:1/\x00", "control"),
        ("redis://h\x7f:1", "control"),
        ("cpu://" + "a" * MAX_URL_LENGTH, "characters long"),
        ("redis://h:0", "port '0'"),
        ("redis://h:65536", "port '65536'"),
        ("redis://h:99999999999999999999", "port"),
        ("redis://h:abc", "port 'abc'"),
        ("redis://h:-1", "port '-1'"),
        ("redis://h:+1", "port '+1'"),
        ("redis://h:", "port ''"),
        ("redis://h:\u00b2", "port"),
        ("redis://h:\u0661\u0662", "port"),
        ("redis://h:1:2", "port '1:2'"),
        ("redis://[::1", "without ']'"),
        ("redis://[::1:6379", "without ']'"),
        ("redis://[]:6379", "not an IPv6 address"),
        ("redis://[zz::1]:6379", "not an IPv6 address"),
        ("redis://[::1]6379", "after ']'"),
        ("redis://::1:6379", "not a valid host name"),
        ("redis://h1:1,,h2:2", "not a valid host name"),
        ("redis://h1:1,", "not a valid host name"),
        ("redis://h\u00e9:1", "not a valid host name"),
        ("cpu://?a=1&a=2", "given twice"),
        ("cpu://?a=1&b=2&a=1", "given twice"),
        ("cpu://?novalue", "not k=v"),
        ("cpu://?a=1&&b=2", "not k=v"),
        ("cpu://#frag", "fragment"),
        ("cpu://#", "fragment"),
        ("redis://h:1/0#x", "fragment"),
    ],
)
def test_hostile_inputs_raise_invalid_backend_url(text: str, problem: str) -> None:
    with pytest.raises(InvalidBackendURL) as info:
        BackendURL.parse(text)
    assert problem in str(info.value)
    assert isinstance(info.value, ConfigError)
    assert str(info.value).startswith("invalid backend URL")


def test_very_long_url_error_is_short() -> None:
    with pytest.raises(InvalidBackendURL) as info:
        BackendURL.parse("redis://h/" + "x" * 1_000_000)
    assert len(str(info.value)) < 300
    assert "1000010 characters long" in str(info.value)


@pytest.mark.parametrize("value", [None, 123, b"cpu://", ["cpu://"], 1.5])
def test_non_string_input_raises_invalid_backend_url(value: object) -> None:
    with pytest.raises(InvalidBackendURL, match="must be a string"):
        BackendURL.parse(value)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_text_parses_or_raises_invalid_backend_url(text: str) -> None:
    try:
        url = BackendURL.parse(text)
    except InvalidBackendURL:
        return
    assert BackendURL.parse(url.secret_url()) == url


@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"[a-z]{1,6}://[a-z0-9@:\[\],./?=&%#-]{0,40}", fullmatch=True))
def test_url_shaped_text_parses_or_raises_invalid_backend_url(text: str) -> None:
    try:
        url = BackendURL.parse(text)
    except InvalidBackendURL:
        return
    assert all(port is None or 0 < port < 65536 for _, port in url.hosts)
    assert BackendURL.parse(url.secret_url()) == url


# --------------------------------------------------------------------------- with_options


def test_with_options_adds_and_replaces_and_stringifies() -> None:
    url = BackendURL.parse(f"redis://u:{SECRET}@h:1/0?db=2&timeout=1")
    new = url.with_options(timeout=5, ssl=True, name="x y")
    assert new.options == {"db": "2", "timeout": "5", "ssl": "True", "name": "x y"}
    assert url.options == {"db": "2", "timeout": "1"}
    assert (new.scheme, new.hosts, new.path, new.username, new.password) == (
        "redis",
        (("h", 1),),
        "/0",
        "u",
        SECRET,
    )
    assert SECRET not in str(new)
    assert BackendURL.parse(new.secret_url()) == new
    assert url.with_options() == url


# --------------------------------------------------------------------------- split_chain


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("cpu://", ["cpu://"]),
        ("audit::cpu://", ["audit", "cpu://"]),
        ("audit::redis://h:6379", ["audit", "redis://h:6379"]),
        ("audit://?x=1::redis://[::1]:6379", ["audit://?x=1", "redis://[::1]:6379"]),
        ("redis://[::1]:6379", ["redis://[::1]:6379"]),
        ("redis+sentinel://[::1]:1,[fe80::2]:2/m", ["redis+sentinel://[::1]:1,[fe80::2]:2/m"]),
        ("a::b://?x=1::cpu://", ["a", "b://?x=1", "cpu://"]),
        ("audit::redis://[::1", ["audit", "redis://[::1"]),
    ],
)
def test_split_chain(text: str, parts: list[str]) -> None:
    assert split_chain(text) == parts


def test_split_chain_parts_parse() -> None:
    wrapper, inner = split_chain("audit://?fail_rate=0.01::redis://u:pw@[::1]:6379/0")
    assert BackendURL.parse(wrapper).options == {"fail_rate": "0.01"}
    parsed = BackendURL.parse(inner)
    assert parsed.hosts == (("::1", 6379),)
    assert parsed.password == "pw"


@pytest.mark.parametrize(
    "text", ["", "::", "audit::", "::cpu://", "audit::::cpu://", "a::b::", ":::cpu://"]
)
def test_split_chain_rejects_empty_parts(text: str) -> None:
    with pytest.raises(InvalidBackendURL, match="empty part"):
        split_chain(text)
