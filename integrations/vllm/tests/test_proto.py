from conftest import chunk_keys, payloads, ROW_BYTES

def test_roundtrip(start, tmp_path):
    url = f"file://{tmp_path}/kv"
    first = start({"url": url})
    keys = chunk_keys(4)
    data = payloads(4, ROW_BYTES)
    assert first.offload(keys, data) == keys
    first.settle()
    print(first.tier.health())
    first.close()
    second = start({"url": url})
    got = second.fetch(keys)
    print(second.tier.health())
    assert got == data
