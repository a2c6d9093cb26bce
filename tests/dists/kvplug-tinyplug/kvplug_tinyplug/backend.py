from kvplug import BytesBackend, Capabilities


class TinyBackend(BytesBackend):
    capabilities = Capabilities(remove=True)

    def __init__(self, url, **kwargs):
        super().__init__(url, **kwargs)
        self.values = {}

    async def get_bytes(self, key):
        return self.values.get(key)

    async def put_bytes(self, key, parts):
        self.values[key] = b"".join(parts)

    async def contains_bytes(self, key):
        return key in self.values

    async def remove_bytes(self, key):
        return self.values.pop(key, None) is not None
