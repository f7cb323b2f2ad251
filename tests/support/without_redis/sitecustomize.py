"""Put on PYTHONPATH, makes a Python process one where the ``redis`` extra is not
installed: redis-py and ``packaging`` (which kombu's Redis transport imports) cannot be
imported."""

import sys

MISSING = ("redis", "packaging")


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
